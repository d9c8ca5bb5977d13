"""Shared pyqtgraph set-up for the charts: dark background, axis units for byte sizes."""

from __future__ import annotations

import pyqtgraph as pg

from app import theme

pg.setConfigOptions(antialias=True, background=theme.PANEL, foreground=theme.TEXT)

HISTORY_S = 3600          # seconds of samples kept (4 Hz x 1 h = 14,400 rows per chart)
TICK_HZ = 4


def byte_unit(max_value: float) -> tuple[float, str]:
    """A divisor and a unit name that keep `max_value` between 1 and 1024."""
    for div, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if max_value >= div:
            return float(div), name
    return 1.0, "B"


def x_left(oldest: float | None, now: float, window_s: float) -> float:
    """The left end of the time axis: the window, or less while there is less history (min 10 s)."""
    if oldest is None:
        return -window_s
    return max(-window_s, min(-10.0, oldest - now))


def make_plot(title: str, left: str) -> pg.PlotWidget:
    w = pg.PlotWidget()
    w.setTitle(f"<span style='color:{theme.TEXT}'>{title}</span>", size="9pt")
    w.setLabel("left", left)
    w.setLabel("bottom", "seconds ago")
    for side in ("left", "bottom"):    # (values under one, e.g. a single plan tier, would read "(x0.001)")
        w.getAxis(side).enableAutoSIPrefix(False)
    w.showGrid(x=True, y=True, alpha=0.15)
    w.setMenuEnabled(False)
    w.setMouseEnabled(x=False, y=False)
    w.hideButtons()
    w.setMinimumHeight(120)
    return w
