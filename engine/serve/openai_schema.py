"""OpenAI request bodies → `GenerationRequest`: validation with one-line 400s that name the field.

Accepted: `/v1/chat/completions` (`messages`, with text and `image_url` data-URL parts) and
`/v1/completions` (`prompt`: a string or a list of one string); `model` (any name: one model is loaded),
`max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `top_k` (an extension), `stop` (a string
or a list), `stream`, `stream_options.include_usage`, `seed`, `n` (1 only). Features the engine does not
have (tools, logprobs, n > 1, JSON mode, echo) are refused with a 400; harmless extras (`user`,
penalties, `metadata`, ...) are ignored.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass, field

from engine.serve.errors import bad_request

MAX_STOP = 16
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass(slots=True)
class GenerationRequest:
    kind: str                                # "chat" | "completion"
    prompt: object                           # a str (completion) or HF-style messages (chat)
    images: list[bytes] = field(default_factory=list)
    model: str | None = None
    max_tokens: int | None = None            # None = as much as the context leaves
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False

    def engine_kwargs(self, context_length: int) -> dict:
        top_p, temperature = self.top_p, self.temperature
        if top_p == 0:           # some clients send top_p=0 to mean "always the likeliest token"
            top_p, temperature = 1.0, 0.0
        return {"max_new_tokens": self.max_tokens if self.max_tokens is not None else max(1, context_length),
                "temperature": temperature, "top_p": top_p, "top_k": self.top_k, "stop": self.stop or None,
                "seed": self.seed, "images": self.images or None}


def parse_chat(body: dict) -> GenerationRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: expected a non-empty list of {role, content} objects", "messages")
    converted: list[dict] = []
    images: list[bytes] = []
    for i, m in enumerate(messages):
        converted.append(_message(m, i, images))
    req = GenerationRequest("chat", converted, images)
    _common(body, req, max_names=("max_completion_tokens", "max_tokens"))
    _refuse_chat_only(body)
    return req


def parse_completion(body: dict) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise bad_request("prompt: expected a string or a list of exactly one string (one prompt per "
                              "request; token-id prompts are not supported)", "prompt")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request(f"prompt: expected a string, got {_kind(prompt)}", "prompt")
    req = GenerationRequest("completion", prompt)
    _common(body, req, max_names=("max_tokens",))
    if body.get("echo"):
        raise bad_request("echo=true: not supported", "echo")
    if body.get("suffix"):
        raise bad_request("suffix: not supported (no fill-in-the-middle)", "suffix")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad_request(f"best_of={best_of!r}: only 1 is supported", "best_of")
    if body.get("logprobs") not in (None, 0, False):
        raise bad_request("logprobs: not supported", "logprobs")
    return req


# ---- pieces ----------------------------------------------------------------------------------------
def _common(body: dict, req: GenerationRequest, max_names: tuple[str, ...]) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model: expected a string, got {_kind(model)}", "model")
    req.model = model
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise bad_request(f"n={n!r}: only n=1 is supported (one choice per request)", "n")
    for name in max_names:
        if body.get(name) is not None:
            req.max_tokens = int(_number(body, name, 1, 1 << 24, integer=True))
            break
    req.temperature = _number(body, "temperature", 0.0, 2.0, default=1.0)
    req.top_p = _number(body, "top_p", 0.0, 1.0, default=1.0)
    req.top_k = int(_number(body, "top_k", 0, 1 << 24, default=0, integer=True))
    if body.get("seed") is not None:
        req.seed = int(_number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True))
    req.stop = _stop(body.get("stop"))
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request(f"stream: expected true or false, got {_kind(stream)}", "stream")
    req.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(f"stream_options: expected an object, got {_kind(options)}", "stream_options")
        req.include_usage = bool(options.get("include_usage"))


def _refuse_chat_only(body: dict) -> None:
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools: not supported (no function calling)", "tools")
    if body.get("logprobs") or body.get("top_logprobs") is not None:
        raise bad_request("logprobs: not supported", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        raise bad_request("response_format: only {\"type\": \"text\"} is supported", "response_format")
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"text"}):
        raise bad_request(f"modalities={modalities!r}: only [\"text\"] is supported", "modalities")


def _number(body: dict, name: str, lo: float, hi: float, default: float | None = None,
            integer: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)):
        raise bad_request(f"{name}: expected {'an integer' if integer else 'a number'}, got {value!r}", name)
    if not lo <= value <= hi:
        raise bad_request(f"{name}={value!r}: must be from {lo:g} to {hi:g}", name)
    return value


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("stop: expected a string or a list of strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad_request(f"stop: {len(stop)} strings, at most {MAX_STOP}", "stop")
    return [s for s in stop if s]


def _message(m, i: int, images: list[bytes]) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where}: expected an object with 'role' and 'content', got {_kind(m)}", "messages")
    role = m.get("role")
    if role not in _ROLES:
        raise bad_request(f"{where}.role={role!r}: expected one of system, developer, user, assistant", "messages")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, str):
        return {"role": _ROLES[role], "content": content}
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of content parts, got {_kind(content)}",
                          "messages")
    parts: list[dict] = []
    texts: list[str] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
            texts.append(part["text"])
        elif kind == "image_url":
            images.append(_image(part.get("image_url"), f"{where}.content[{j}].image_url"))
            parts.append({"type": "image"})
        else:
            raise bad_request(f"{where}.content[{j}]: expected {{\"type\": \"text\", \"text\": ...}} or "
                              f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}, got type={kind!r}",
                              "messages")
    if any(p["type"] == "image" for p in parts):
        return {"role": _ROLES[role], "content": parts}
    return {"role": _ROLES[role], "content": "\n".join(texts)}


def _image(spec, where: str) -> bytes:
    url = spec.get("url") if isinstance(spec, dict) else spec
    if not isinstance(url, str):
        raise bad_request(f"{where}.url: expected a data: URL string", "messages")
    if not url.startswith("data:"):
        raise bad_request(f"{where}.url: only data: URLs (base64 images) are accepted; Slipstream never "
                          f"downloads (got {url[:40]!r})", "messages")
    header, comma, data = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise bad_request(f"{where}.url: expected data:<type>;base64,<data>", "messages")
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{where}.url: not valid base64 ({exc})", "messages") from exc
    if not raw:
        raise bad_request(f"{where}.url: the image is empty", "messages")
    return raw


def _kind(value) -> str:
    return "null" if value is None else type(value).__name__
