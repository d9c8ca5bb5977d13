"""`RingBuffer`: a fixed number of rows of float columns, so charts use bounded memory over hours."""

from __future__ import annotations

import numpy as np


class RingBuffer:
    def __init__(self, capacity: int, columns: int):
        self.capacity = int(capacity)
        self._data = np.full((self.capacity, columns), np.nan, dtype=np.float64)
        self._next = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, *row: float) -> None:
        self._data[self._next] = [np.nan if v is None else v for v in row]
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def view(self) -> np.ndarray:
        """The rows oldest first (a copy)."""
        if self._size < self.capacity:
            return self._data[: self._size].copy()
        return np.concatenate([self._data[self._next:], self._data[: self._next]])

    def last(self) -> np.ndarray | None:
        if not self._size:
            return None
        return self._data[(self._next - 1) % self.capacity].copy()

    def nbytes(self) -> int:
        return int(self._data.nbytes)
