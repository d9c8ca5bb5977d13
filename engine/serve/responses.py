"""OpenAI response objects: chat completions and their stream chunks, text completions, models, usage.

Finish reasons map the engine's onto OpenAI's: `eos` and `stop` → "stop", `length` → "length" (a
`cancelled` generation, which only a stopping server sees, reads "stop").
"""

from __future__ import annotations

import secrets
import time

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def finish_reason(engine_reason: str | None) -> str | None:
    return None if engine_reason is None else FINISH_REASONS.get(engine_reason, "stop")


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseBuilder:
    """Builds the objects of one request (same id, creation time and model name throughout)."""

    def __init__(self, kind: str, model: str):
        self.kind = kind
        self.id = new_id(kind)
        self.created = int(time.time())
        self.model = model

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    def full(self, text: str, reason: str, usage_: dict) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": finish_reason(reason)}
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage_}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage_}

    def chunk(self, text: str | None, reason: str | None = None, first: bool = False) -> dict:
        """One streamed piece; `reason` set on the last one. Chat's first chunk carries the role."""
        if self.kind == "chat":
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason(reason)}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage_: dict) -> dict:
        """The extra last chunk of `stream_options: {"include_usage": true}` (no choices)."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_}


def model_card(name: str, created: int, context_length: int | None = None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "slipstream"}
    if context_length:
        card["context_length"] = context_length
    return card


def model_list(cards: list[dict]) -> dict:
    return {"object": "list", "data": cards}
