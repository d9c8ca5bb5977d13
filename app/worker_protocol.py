"""The app's side of the worker protocol (docs/PROTOCOL.md): request encoding and event line parsing.

The worker's side is `engine/worker.py`; the app may not import it (the engine package imports torch),
so both sides carry `PROTOCOL_VERSION` and a test checks that they agree.
"""

from __future__ import annotations

import json
from typing import Any

PROTOCOL_VERSION = 1
REQUESTS = ("load", "generate", "cancel", "set_budget", "force_plan", "plan_report", "stats", "unload",
            "api_start", "api_stop", "shutdown")
EVENTS = ("ready", "load_progress", "loaded", "token", "done", "error", "plan", "metrics", "stats",
          "unloaded", "api", "bye")


def encode_request(type_: str, **fields: Any) -> bytes:
    if type_ not in REQUESTS:
        raise ValueError(f"unknown request type {type_!r}")
    return (json.dumps({"type": type_, **fields}, separators=(",", ":")) + "\n").encode("utf-8")


class LineDecoder:
    """Splits the worker's stdout into events; a line that is not a JSON object becomes a log line."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> tuple[list[dict], list[str]]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        events: list[dict] = []
        junk: list[str] = []
        for raw in lines:
            text = raw.decode("utf-8", errors="replace").strip()
            if not text:
                continue
            try:
                event = json.loads(text)
            except ValueError:
                junk.append(text)
                continue
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                events.append(event)
            else:
                junk.append(text)
        return events, junk
