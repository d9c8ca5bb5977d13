"""The engine's tokenizer: a `tokenizers.Tokenizer` plus the model's Jinja chat template.

`ChatTokenizer` implements `engine.loading.loaded.Tokenizer` for both Hugging Face folders and GGUF
files (the loaders build the `tokenizers.Tokenizer`). Chat templates render the way transformers renders
them: a sandboxed Jinja environment with trim_blocks/lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, the `tojson` filter, `{% generation %}` blocks, and the special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import ClassVar

from engine.errors import BadInputError


class ChatTokenizer:
    """Encode/decode with a `tokenizers.Tokenizer`; render chat messages with the model's template."""

    def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 eos_token_ids: set[int] | None = None, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, vocab_size: int | None = None,
                 name: str = "model") -> None:
        self.backend = backend
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        ids = set(eos_token_ids or ())
        if eos_token and backend.token_to_id(eos_token) is not None:
            ids.add(backend.token_to_id(eos_token))
        self.eos_token_ids = ids
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        probe_with = backend.encode("a", add_special_tokens=True).ids
        self.add_bos = self.bos_token_id is not None and probe_with[:1] == [self.bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not self.chat_template:
            raise BadInputError(f"{self.name}: the model has no chat template; pass a plain text prompt")
        variables = {**self.special_tokens, "bos_token": self.bos_token or "",
                     "eos_token": self.eos_token or "", **kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **variables)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **variables) -> str:
    """Render a Hugging Face chat template; template errors become one-line `BadInputError`s."""
    from jinja2 import TemplateError

    try:
        compiled = _compile(template)
    except TemplateError as exc:
        raise BadInputError(f"chat template: does not parse ({exc})") from exc
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **variables)
    except TemplateError as exc:
        raise BadInputError(f"chat template: {exc}") from exc


def _raise_exception(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_generation_extension(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@lru_cache(maxsize=1)
def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training): render the body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return GenerationBlock
