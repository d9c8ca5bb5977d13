"""The plan in use for each token tier over time: one row per tier, a bar per stretch of one plan,
coloured by plan kind, taller the more sub-layers are resident; vertical marks where a re-plan happened."""

from __future__ import annotations

import collections

import numpy as np
import pyqtgraph as pg

from app import theme
from app.charts.style import make_plot, x_left

MAX_SEGMENTS = 2000     # per tier
MAX_MARKS = 200


class PlanChart:
    def __init__(self, window_s: float = 120.0):
        self.window_s = window_s
        self.tiers: list[int] = []
        self.segments: dict[int, collections.deque[list]] = {}    # tier -> [t0, t1, kind, resident share]
        self.marks: collections.deque[tuple[float, str]] = collections.deque(maxlen=MAX_MARKS)
        self.widget = make_plot("Plan per token tier", "tier")
        self._bars = pg.BarGraphItem(x0=[], x1=[], y=[], height=[], brushes=[])
        self._marks = pg.PlotDataItem(pen=pg.mkPen(theme.BUDGET, width=1.5), connect="pairs")
        self.widget.addItem(self._bars)
        self.widget.addItem(self._marks)
        self.caption = ""
        self._legend = "  ".join(f"<span style='color:{c}'>■</span> {k}" for k, c in theme.PLAN_COLORS.items()
                                 if k != "cpu")
        self._set_title()
        self.current: dict[int, tuple[str, float]] = {}

    def _set_title(self) -> None:
        sub = f"<br><span style='color:{theme.BUDGET}; font-size:8pt'>{self.caption}</span>" if self.caption else ""
        self.widget.setTitle(f"<span style='color:{theme.TEXT}'>Plan per token tier</span>"
                             f"<span style='color:{theme.MUTED}'>&nbsp;&nbsp;{self._legend}</span>{sub}", size="9pt")

    def sample(self, t: float, report: dict | None) -> None:
        """Record the plan in use at time `t` (called at the panel's tick)."""
        if not report:
            return
        for tier in report.get("tiers", []):
            n = int(tier.get("tokens", 0))
            kind = str(tier.get("plan", "?"))
            placement = tier.get("placement") or {}
            share = (sum(1 for p in placement.values() if p == "resident") / len(placement)) if placement else 1.0
            self.current[n] = (kind, share)
            segs = self.segments.get(n)
            if segs is None:
                segs = self.segments[n] = collections.deque(maxlen=MAX_SEGMENTS)
                self.tiers = sorted(self.segments)
                self.widget.getAxis("left").setTicks([[(i, str(k)) for i, k in enumerate(self.tiers)]])
            if segs and segs[-1][2] == kind and abs(segs[-1][3] - share) < 1e-9 and t - segs[-1][1] < 5:
                segs[-1][1] = t
            else:
                if segs:
                    segs[-1][1] = max(segs[-1][1], t)   # close the previous stretch where this one starts
                segs.append([t, t, kind, share])

    def mark_replan(self, t: float, reason: str) -> None:
        self.marks.append((t, reason))

    def redraw(self, now: float) -> None:
        x0, x1, y, h, brushes = [], [], [], [], []
        start = now - self.window_s
        oldest = min((segs[0][0] for segs in self.segments.values() if segs), default=None)
        for row, tier in enumerate(self.tiers):
            for t0, t1, kind, share in self.segments[tier]:
                if t1 < start:
                    continue
                x0.append(max(t0, start) - now)
                x1.append(max(t1, t0 + 0.25) - now)
                y.append(row)
                h.append(0.25 + 0.6 * share)
                brushes.append(pg.mkBrush(theme.PLAN_COLORS.get(kind, theme.WARN)))
        self._bars.setOpts(x0=x0, x1=x1, y=y, height=h, brushes=brushes)
        marks = [t - now for t, _ in self.marks if t >= start]
        top = max(len(self.tiers), 1) - 0.5
        xs = np.repeat(np.array(marks, dtype=float), 2)
        ys = np.tile(np.array([-0.5, top]), len(marks))
        self._marks.setData(xs, ys)
        if self.marks:
            t, reason = self.marks[-1]
            self.caption = f"last re-plan {now - t:.0f} s ago: {reason}"
            self._set_title()
        self.widget.setXRange(x_left(oldest, now, self.window_s), 0, padding=0)
        self.widget.setYRange(-0.6, top + 0.1, padding=0)
