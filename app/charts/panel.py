"""`ChartsPanel`: the four live charts, sampled and redrawn at 4 Hz from a `LiveState`."""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QSplitter, QVBoxLayout, QWidget

from app.charts.plan_chart import PlanChart
from app.charts.speed_chart import SpeedChart, TtftChart
from app.charts.style import TICK_HZ
from app.charts.vram_chart import VramChart
from app.live_state import LiveState


class ChartsPanel(QWidget):
    def __init__(self, state: LiveState, window_s: float = 120.0, parent: QWidget | None = None):
        super().__init__(parent)
        self.state = state
        self.vram = VramChart(window_s)
        self.speed = SpeedChart(window_s)
        self.ttft = TtftChart()
        self.plan = PlanChart(window_s)
        split = QSplitter()
        split.setOrientation(split.orientation().Vertical)
        for chart in (self.vram, self.plan, self.speed, self.ttft):
            split.addWidget(chart.widget)
        split.setSizes([260, 200, 150, 130])
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(split)
        self.timer = QTimer(self)
        self.timer.setInterval(1000 // TICK_HZ)
        self.timer.timeout.connect(self.tick)
        self.timer.start()

    def tick(self) -> None:
        now = time.time()
        own, games, others, total, note = self.state.vram_sample()
        budget = self.state.budget
        if budget is None and self.state.plan_report:
            budget = self.state.plan_report.get("budget")
        self.vram.add(now, own, games, others, budget, total)
        self.vram.set_note(note)
        metrics = self.state.fresh_metrics()
        self.speed.add(now, metrics.get("tokens_per_s") if self.state.generating else None)
        self.plan.sample(now, self.state.plan_report)
        if self.isVisible():
            self.redraw(now)

    def redraw(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        for chart in (self.vram, self.speed, self.ttft, self.plan):
            chart.redraw(now)

    def mark_replan(self, reason: str) -> None:
        self.plan.mark_replan(time.time(), reason)
        self.plan.sample(time.time(), self.state.plan_report)

    def add_request(self, ttft_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.add(ttft_s)
