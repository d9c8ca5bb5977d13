"""`EngineSlot`: the engine the API serves, behind the generation gate.

`slot.generation(request, abandon)` waits for the request's turn (first come, first served; a client
that hangs up while queued leaves the queue), starts the generation, and hands back a `Generation`
whose `pieces()` stream the text. An engine that batches (it has `submit`) takes requests side by side:
they hold the gate shared and share the engine's batched steps, each request its own stream; other
engines run one generation at a time (`engine.generate`, the gate held exclusively). Input the engine
refuses (a prompt over the context, images for a text-only model) becomes a 400 before anything is sent. A client that hangs up mid-generation cancels
it (the engine stops after its current step). The same slot works for the standalone server and inside
the app's worker, where the worker's chat jobs share the gate.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.errors import ContextLengthError, SlipstreamError
from engine.generation import CancelToken
from engine.serve.errors import ApiError, ClientGone
from engine.serve.gate import GateAbandoned, GateClosed, GenerationGate
from engine.serve.openai_schema import GenerationRequest
from engine.serve.responses import model_card


def model_name(engine) -> str:
    """A model's API name: the GGUF file's stem or the Hugging Face folder's name."""
    path = Path(str(getattr(engine, "source", "") or "model"))
    return path.stem if path.suffix.lower() == ".gguf" else (path.name or "model")


def _batches(engine) -> bool:
    """Whether the engine runs concurrent requests in one batch (`submit`)."""
    return engine is not None and callable(getattr(engine, "submit", None))


class Generation:
    """One running generation: `pieces()` yields text; afterwards `finish_reason` and the token counts."""

    def __init__(self, events, cancel: CancelToken, abandon: Callable[[], bool], prompt_tokens: int | None,
                 model: str, on_token: Callable[[], None] | None, stats: Callable[[], dict] | None = None):
        self._events = events
        self.cancel_token = cancel
        self._abandon = abandon
        self._counted = prompt_tokens
        self._stats = stats
        self.completion_tokens = 0
        self.model = model
        self.finish_reason: str | None = None
        self.client_gone = False
        self._on_token = on_token

    @property
    def prompt_tokens(self) -> int:
        if self._counted is None and self._stats is not None and self.finish_reason is not None:
            self._counted = int(self._stats().get("prompt_tokens") or 0)
        return self._counted or 0

    def pieces(self) -> Iterator[str]:
        for ev in self._events:
            if ev.finish_reason is not None:
                self.finish_reason = ev.finish_reason
                self.completion_tokens = ev.index
                if ev.text and not self.client_gone:
                    yield ev.text
                return
            if self._on_token is not None:
                self._on_token()
            if not self.client_gone and self._abandon():
                self.client_gone = True
                self.cancel_token.cancel()      # the engine stops after this step; drain to its last event
            if ev.text and not self.client_gone:
                yield ev.text

    def close(self) -> None:
        if self.finish_reason is None:
            self.cancel_token.cancel()
            with contextlib.suppress(Exception):     # the request is over either way
                for _ in self._events:              # at most one more step, then the final event
                    pass
        self._events.close()


class EngineSlot:
    """Serves one engine (or whatever `get_engine()` returns now) to the API: concurrent requests share
    a batching engine's steps; other engines serve one generation at a time."""

    def __init__(self, engine_or_getter, *, gate: GenerationGate | None = None,
                 name: Callable[[], str | None] | None = None, max_waiting: int = 64,
                 on_busy: Callable[[bool], None] | None = None, on_token: Callable[[], None] | None = None):
        self._get = engine_or_getter if callable(engine_or_getter) else (lambda: engine_or_getter)
        self.gate = gate or GenerationGate()
        self._name = name
        self.max_waiting = max_waiting
        self.not_ready_message = "no model is loaded"
        self._on_busy = on_busy
        self._on_token = on_token
        self._active: set[CancelToken] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.created = int(time.time())

    def engine(self):
        return self._get()

    def model_name(self) -> str | None:
        engine = self._get()
        if engine is None:
            return None
        return (self._name() if self._name else None) or model_name(engine)

    def model_cards(self) -> list[dict]:
        engine = self._get()
        name = self.model_name()
        if engine is None or not name:
            return []
        return [model_card(name, self.created, int(getattr(engine, "context_length", 0) or 0))]

    @property
    def active(self) -> int:
        """Generations this slot is running now."""
        with self._lock:
            return len(self._active)

    def close(self) -> None:
        """Cancel running generations and refuse queued and new ones (the server is stopping)."""
        self._closed = True
        with self._lock:
            for token in list(self._active):
                token.cancel()

    @contextmanager
    def generation(self, req: GenerationRequest, abandon: Callable[[], bool]) -> Iterator[Generation]:
        if self._closed:
            raise ApiError(503, "the server is stopping", "server_error", code="server_stopping")
        waiting = self._waiting()
        if waiting >= self.max_waiting:
            raise ApiError(429, f"{waiting} requests are already waiting for the model; try again later",
                           "rate_limit_error", code="queue_full", headers={"Retry-After": "5"})
        shared = _batches(self._get())
        try:
            self.gate.acquire(abandon=abandon, closed=lambda: self._closed, shared=shared)
        except GateAbandoned:
            raise ClientGone() from None
        except GateClosed:
            raise ApiError(503, "the server is stopping", "server_error", code="server_stopping") from None
        token = CancelToken()
        try:
            engine = self._get()
            if engine is None:
                raise ApiError(503, self.not_ready_message, "server_error", code="model_not_loaded")
            with self._lock:
                self._active.add(token)
            if self._closed:
                token.cancel()
            gen = self._start(engine, req, token, abandon)
            if self._on_busy is not None:
                self._on_busy(True)
            try:
                yield gen
            finally:
                gen.close()
                if self._on_busy is not None:
                    self._on_busy(False)
        finally:
            with self._lock:
                self._active.discard(token)
            self.gate.release(shared=shared)

    def _waiting(self) -> int:
        """Requests waiting for the model: at the gate, and in a batching engine's queue."""
        engine = self._get()
        queued = int(engine.stats().get("waiting") or 0) if _batches(engine) else 0
        return self.gate.waiting + queued

    def _start(self, engine, req: GenerationRequest, token: CancelToken, abandon) -> Generation:
        kwargs = req.engine_kwargs(int(getattr(engine, "context_length", 0) or 0))
        images = kwargs.pop("images")
        param = "messages" if req.kind == "chat" else "prompt"
        try:
            # Text prompts are counted here (cheap); with images the engine's own count is read at the end,
            # so the images are not processed twice.
            if _batches(engine):
                events = engine.submit(req.prompt, images=images, cancel=token, **kwargs)
                n_prompt = len(events.request.prompt)
            else:
                n_prompt = None if images else len(engine.encode_prompt(req.prompt))
                events = engine.generate(req.prompt, images=images, cancel=token, **kwargs)
        except ContextLengthError as exc:
            raise ApiError(400, f"{param}: {exc}", code="context_length_exceeded", param=param) from exc
        except SlipstreamError as exc:
            raise ApiError(400, str(exc), code="invalid_value", param=param) from exc
        return Generation(events, token, abandon, n_prompt, self.model_name() or "model", self._on_token,
                          stats=engine.stats)
