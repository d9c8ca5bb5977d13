"""The worker's protocol stream as the in-process worker tests read it."""

from __future__ import annotations

import json
import threading


class EventSink:
    """The worker's protocol stream: every JSON line, parsed, in arrival order (metrics left out)."""

    def __init__(self):
        self.events: list[dict] = []
        self._cond = threading.Condition()
        self._buf = b""

    def write(self, data: bytes) -> None:
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            ev = json.loads(line)
            if ev["type"] != "metrics":
                with self._cond:
                    self.events.append(ev)
                    self._cond.notify_all()

    def flush(self) -> None:
        pass

    def wait_for(self, type_: str, timeout: float = 90.0, **match) -> dict:
        def found():
            for ev in self.events:
                assert not (ev["type"] == "error" and ev.get("kind") == "load"), ev
                if ev["type"] == type_ and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            return None

        with self._cond:
            assert self._cond.wait_for(found, timeout), f"no {type_} {match}: {self.events[-5:]}"
            return found()

    def of(self, rid: str, type_: str = "token") -> list[dict]:
        with self._cond:
            return [e for e in self.events if e["type"] == type_ and e.get("id") == rid]
