"""The ring buffer of recent snapshots the charts draw from: fixed capacity, so memory stays bounded."""

from __future__ import annotations

import threading
from collections import deque

from monitor.snapshot import Snapshot


class History:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity {capacity}: must be at least 1")
        self._items: deque[Snapshot] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self._items.maxlen or 0

    def append(self, snap: Snapshot) -> None:
        with self._lock:
            self._items.append(snap)

    def latest(self) -> Snapshot | None:
        with self._lock:
            return self._items[-1] if self._items else None

    def since(self, seconds: float | None = None) -> list[Snapshot]:
        """Oldest first; only the last `seconds` (by the snapshots' own clock) when given."""
        with self._lock:
            items = list(self._items)
        if seconds is None or not items:
            return items
        start = items[-1].time - seconds
        i = len(items)
        while i > 0 and items[i - 1].time >= start:
            i -= 1
        return items[i:]

    def __len__(self) -> int:
        return len(self._items)
