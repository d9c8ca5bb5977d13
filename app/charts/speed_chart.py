"""Tokens per second over time, and time to first token for each request."""

from __future__ import annotations

import collections

import numpy as np
import pyqtgraph as pg

from app import theme
from app.charts.ring_buffer import RingBuffer
from app.charts.style import HISTORY_S, TICK_HZ, make_plot, x_left

MAX_REQUESTS = 60


class SpeedChart:
    def __init__(self, window_s: float = 120.0):
        self.window_s = window_s
        self.buffer = RingBuffer(HISTORY_S * TICK_HZ, 2)
        self.widget = make_plot("Decode speed", "tokens/s")
        self._curve = self.widget.plot(pen=pg.mkPen(theme.GOOD, width=2), connect="finite")

    def add(self, t: float, tokens_per_s: float | None) -> None:
        self.buffer.append(t, tokens_per_s)

    def redraw(self, now: float) -> None:
        rows = self.buffer.view()
        if not len(rows):
            return
        rows = rows[rows[:, 0] >= now - self.window_s - 1]
        self._curve.setData(rows[:, 0] - now, rows[:, 1])
        top = np.nanmax(np.concatenate([rows[:, 1], [1.0]]))
        self.widget.setXRange(x_left(rows[0, 0] if len(rows) else None, now, self.window_s), 0, padding=0)
        self.widget.setYRange(0, top * 1.15, padding=0)


class TtftChart:
    """One bar per request (the last `MAX_REQUESTS`), in milliseconds."""

    def __init__(self):
        self.values: collections.deque[tuple[int, float]] = collections.deque(maxlen=MAX_REQUESTS)
        self._count = 0
        self.widget = make_plot("Time to first token", "ms")
        self.widget.setLabel("bottom", "request")
        self.widget.getAxis("bottom").setTickSpacing(major=5, minor=1)
        self._bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=pg.mkBrush(theme.ACCENT))
        self.widget.addItem(self._bars)
        self._dirty = False

    def add(self, ttft_s: float) -> None:
        self._count += 1
        self.values.append((self._count, ttft_s * 1000.0))
        self._dirty = True

    def redraw(self, now: float) -> None:
        if not self._dirty:
            return
        self._dirty = False
        xs = [v[0] for v in self.values]
        hs = [v[1] for v in self.values]
        self._bars.setOpts(x=xs, height=hs, width=0.7)
        if xs:
            right = max(xs[-1], 10) + 0.5
            self.widget.setXRange(max(0.5, right - MAX_REQUESTS), right, padding=0)
            self.widget.setYRange(0, max(hs) * 1.15 + 1e-3, padding=0)
