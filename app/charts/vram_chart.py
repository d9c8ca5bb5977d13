"""VRAM over time, stacked by process (Slipstream at the bottom, then games, then others), with the
budget line and the GPU's total memory."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app import theme
from app.charts.ring_buffer import RingBuffer
from app.charts.style import HISTORY_S, TICK_HZ, byte_unit, make_plot, x_left

_T, _OWN, _GAMES, _OTHERS, _BUDGET, _TOTAL = range(6)


class VramChart:
    def __init__(self, window_s: float = 120.0):
        self.window_s = window_s
        self.buffer = RingBuffer(HISTORY_S * TICK_HZ, 6)
        self.widget = make_plot("VRAM by process", "GiB")
        self.widget.addLegend(offset=(4, 2), labelTextSize="8pt", colCount=5, verSpacing=-6)
        plot = self.widget.getPlotItem()
        self._zero = pg.PlotDataItem(pen=pg.mkPen(0, 0, 0, 0))
        self._own = pg.PlotDataItem(pen=pg.mkPen(theme.ACCENT, width=1.5), name="Slipstream")
        self._games = pg.PlotDataItem(pen=pg.mkPen(theme.GAME, width=1.5), name="games")
        self._others = pg.PlotDataItem(pen=pg.mkPen(theme.OTHER, width=1.5), name="others")
        self._budget = pg.PlotDataItem(pen=pg.mkPen(theme.BUDGET, width=2, style=pg.QtCore.Qt.PenStyle.DashLine),
                                       name="budget", connect="finite", stepMode=None)
        self._total = pg.PlotDataItem(pen=pg.mkPen(theme.MUTED, width=1, style=pg.QtCore.Qt.PenStyle.DotLine),
                                      name="GPU total", connect="finite")
        for item in (self._zero, self._own, self._games, self._others, self._budget, self._total):
            plot.addItem(item)
        for lower, upper, color in ((self._zero, self._own, theme.ACCENT), (self._own, self._games, theme.GAME),
                                    (self._games, self._others, theme.OTHER)):
            fill_color = pg.mkColor(color)
            fill_color.setAlpha(110)
            fill = pg.FillBetweenItem(lower, upper, brush=pg.mkBrush(fill_color))
            plot.addItem(fill)
        self._own.setZValue(5)
        self._note = ""
        self._unit = ""

    def add(self, t: float, own: float | None, games: float | None, others: float | None,
            budget: float | None, total: float | None) -> None:
        self.buffer.append(t, own, games, others, budget, total)

    def set_note(self, text: str) -> None:
        """A second title line (e.g. why only Slipstream's own figure is shown)."""
        if text != self._note:
            self._note = text
            sub = f"<br><span style='color:{theme.MUTED}; font-size:8pt'>{text}</span>" if text else ""
            self.widget.setTitle(f"<span style='color:{theme.TEXT}'>VRAM by process</span>{sub}", size="9pt")

    def redraw(self, now: float) -> None:
        rows = self.buffer.view()
        if not len(rows):
            return
        rows = rows[rows[:, _T] >= now - self.window_s - 1]
        x = rows[:, _T] - now
        own = np.nan_to_num(rows[:, _OWN])
        games = own + np.nan_to_num(rows[:, _GAMES])
        others = games + np.nan_to_num(rows[:, _OTHERS])
        budget, total = rows[:, _BUDGET], rows[:, _TOTAL]
        peak = float(np.nanmax(np.concatenate([others, np.nan_to_num(total), [float(1 << 20)]])))
        if not np.isfinite(total).any():
            # No GPU total to scale to: show the budget unless it is far off the scale (a notional one, or
            # an engine holding no VRAM at all, as llama.cpp on the CPU): then no budget line, rather than
            # one drawn where the budget is not.
            scale = max(peak * 4, 1 << 20) if np.nanmax(others) > 0 else 0
            on_scale = np.isfinite(budget) & (budget <= scale)
            peak = max([peak, *budget[on_scale].tolist()])
            budget = np.where(on_scale, budget, np.nan)
        div, unit = byte_unit(peak)
        if unit != self._unit:
            self._unit = unit
            self.widget.setLabel("left", unit)
        self._zero.setData(x, np.zeros_like(x))
        self._own.setData(x, own / div)
        if np.isfinite(rows[:, _GAMES]).any() or np.isfinite(rows[:, _OTHERS]).any():
            self._games.setData(x, games / div)
            self._others.setData(x, others / div)
            self._games.setPen(pg.mkPen(theme.GAME, width=1.5))
            self._others.setPen(pg.mkPen(theme.OTHER, width=1.5))
        else:   # no monitor data: nothing to stack on Slipstream's own figure
            self._games.setData(x, own / div)
            self._others.setData(x, own / div)
            self._games.setPen(None)
            self._others.setPen(None)
        self._budget.setData(x, budget / div)
        self._total.setData(x, total / div)
        self.widget.setXRange(x_left(rows[0, _T], now, self.window_s), 0, padding=0)
        self.widget.setYRange(0, peak / div * 1.22, padding=0)   # headroom for the legend row
