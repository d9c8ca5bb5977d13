"""The engine contract: `open_model` and the `Engine` every backend implements.

`Engine` owns what all backends share: turning a prompt or chat messages into token ids, the context
check, the generation loop's streaming, stop strings, EOS, cancellation and timing stats. A backend
supplies `_token_stream` (token ids, one per step) and `score`; the torch backend also plans and places.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from engine.errors import BadInputError, ContextLengthError
from engine.generation import CancelToken, GenerationEvent, SamplingParams, token_events


class Engine:
    """Base class of the backends. Thread-safe for `set_vram_budget`, `cancel` and the getters."""

    backend: str = "?"
    supports_images: bool = False   # vision-language models set this
    tokenizer = None
    config = None
    context_length: int = 0
    source: str = ""

    def __init__(self) -> None:
        self._stats: dict = {"ttft_s": None, "decode_tokens_per_s": None, "prefill_tokens_per_s": None,
                             "prompt_tokens": 0, "generated_tokens": 0}
        self._cancel: CancelToken | None = None
        self._lock = threading.RLock()   # one generation or score at a time

    # ---- prompts -------------------------------------------------------------------------------
    def encode_prompt(self, prompt_or_messages, images=None) -> list[int]:
        tok = self.tokenizer
        if images:
            raise BadInputError(f"{Path(self.source).name} is a text-only model: it cannot see images "
                                "(open a vision-language model such as Qwen2.5-VL to analyse images)")
        if isinstance(prompt_or_messages, str):
            ids = tok.encode(prompt_or_messages)
            if tok.add_bos and tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id):
                ids = [tok.bos_token_id] + ids
            return ids
        if isinstance(prompt_or_messages, (list, tuple)):
            for i, m in enumerate(prompt_or_messages):
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise BadInputError(f"messages[{i}]: expected a dict with 'role' and 'content'")
            text = tok.apply_chat_template(list(prompt_or_messages), add_generation_prompt=True)
            ids = tok.encode(text)
            if tok.add_bos and tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id):
                ids = [tok.bos_token_id] + ids
            return ids
        raise BadInputError(f"prompt: expected a str or a list of messages, got {type(prompt_or_messages).__name__}")

    def check_context(self, n_prompt: int, max_new_tokens: int) -> int:
        """Raise when the prompt does not fit; return how many new tokens fit after it."""
        if n_prompt == 0:
            raise BadInputError("prompt: empty (no tokens)")
        if n_prompt >= self.context_length:
            raise ContextLengthError(f"prompt of {n_prompt} tokens does not fit the model's context of "
                                     f"{self.context_length} tokens")
        return min(max_new_tokens, self.context_length - n_prompt)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, prompt_or_messages, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop=None, images=None, seed: int | None = None,
                 cancel: CancelToken | None = None) -> Iterator[GenerationEvent]:
        """Stream events; the last one has `finish_reason` set. Validation happens before the first
        event is requested, so bad input raises at the call."""
        ids, params = self.prepare_request(prompt_or_messages, max_new_tokens, temperature, top_p, top_k,
                                           stop, images, seed)
        return self._generate(ids, params, cancel or CancelToken(), images)

    def prepare_request(self, prompt_or_messages, max_new_tokens: int = 256, temperature: float = 0.0,
                        top_p: float = 1.0, top_k: int = 0, stop=None, images=None,
                        seed: int | None = None) -> tuple[list[int], SamplingParams]:
        """Checked sampling parameters and the prompt's token ids, with max_new_tokens cut to the context."""
        params = SamplingParams.make(max_new_tokens, temperature, top_p, top_k, stop, seed)
        ids = self.encode_prompt(prompt_or_messages, images)
        params.max_new_tokens = self.check_context(len(ids), params.max_new_tokens)
        return ids, params

    def _generate(self, ids: list[int], params: SamplingParams, cancel: CancelToken,
                  images) -> Iterator[GenerationEvent]:
        with self._lock:
            self._cancel = cancel
            try:
                yield from token_events(self._token_stream(ids, params, cancel, images), self.tokenizer,
                                        len(ids), params, cancel, self._stats)
            finally:
                self._cancel = None

    def _token_stream(self, ids: list[int], params: SamplingParams, cancel: CancelToken,
                      images) -> Iterator[int]:
        raise NotImplementedError

    def cancel(self) -> None:
        """Stop the running generation after its current step (safe from any thread)."""
        c = self._cancel
        if c is not None:
            c.cancel()

    # ---- the rest of the contract (backends override) ------------------------------------------
    def score(self, token_ids):
        raise NotImplementedError

    def set_vram_budget(self, n_bytes) -> None:
        raise NotImplementedError

    def force_plan(self, kind: str) -> None:
        raise NotImplementedError

    def plan_report(self) -> dict:
        raise NotImplementedError

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_model(source=None, *, device: str = "auto", vram_budget=None, backend: str = "auto",
               **options) -> Engine:
    """Open a model: None = the bundled default; a GGUF file; a Hugging Face folder.

    backend: "torch" (the placing PyTorch executor), "llamacpp" (llama.cpp through llama-cpp-python, GGUF
    only) or "auto" (llama.cpp for a quantized GGUF where no CUDA GPU is present, else torch).
    """
    from engine.errors import BadInputError as _Bad
    from engine.loading.source import resolve_source

    if backend not in ("auto", "torch", "llamacpp"):
        raise _Bad(f"backend={backend!r}: expected 'auto', 'torch' or 'llamacpp'")
    path = resolve_source(source)
    if backend == "auto":
        backend = _choose_backend(path, device)
    if backend == "llamacpp":
        from engine.backends.llamacpp import LlamaCppEngine

        return LlamaCppEngine(path, device=device, vram_budget=vram_budget, **options)
    from engine.backends.torch_engine import TorchEngine

    return TorchEngine(path, device=device, vram_budget=vram_budget, **options)


def _choose_backend(path: Path, device: str) -> str:
    if path.suffix.lower() != ".gguf" or device in ("sim", "cuda") or device.startswith("cuda:"):
        return "torch"
    from engine.loading.source import gguf_is_quantized

    if not gguf_is_quantized(path):
        return "torch"
    import torch

    if torch.cuda.is_available() and device != "cpu":
        return "torch"
    import importlib.util

    # Found, not imported: the llama.cpp backend sets its thread wait policy before llama.cpp loads.
    return "llamacpp" if importlib.util.find_spec("llama_cpp") is not None else "torch"
