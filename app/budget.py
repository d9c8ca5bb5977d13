"""`BudgetController`: which VRAM budget the engine gets, from the user's mode and the monitor.

- auto: the monitor's budget (what the other processes leave, minus the reserve); None where the monitor
  has none (no NVIDIA GPU), which lets the engine decide.
- fixed: the user's cap from the slider.
- pause_when_gaming: 0 (nothing on the GPU) while a game runs, else as auto.
`budgetChanged` fires only when the effective budget changes.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.settings import BUDGET_MODES


class BudgetController(QObject):
    budgetChanged = Signal(object)     # int bytes or None

    def __init__(self, mode: str = "auto", cap: int | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.mode = mode if mode in BUDGET_MODES else "auto"
        self.cap = cap
        self.monitor_budget: int | None = None
        self.gaming = False
        self._effective: int | None = self.effective()

    def effective(self) -> int | None:
        if self.mode == "fixed" and self.cap is not None:
            return self.cap
        if self.mode == "pause_when_gaming" and self.gaming:
            return 0
        return self.monitor_budget

    @property
    def paused(self) -> bool:
        return self.mode == "pause_when_gaming" and self.gaming

    def set_mode(self, mode: str) -> None:
        if mode not in BUDGET_MODES:
            raise ValueError(f"budget mode {mode!r}: expected one of {', '.join(BUDGET_MODES)}")
        self.mode = mode
        self._update()

    def set_cap(self, n_bytes: int) -> None:
        """The slider moved: a fixed cap from now on."""
        self.cap = max(0, int(n_bytes))
        self.mode = "fixed"
        self._update()

    def on_monitor(self, budget: int | None, gaming: bool) -> None:
        self.monitor_budget = budget
        self.gaming = bool(gaming)
        self._update()

    def _update(self) -> None:
        value = self.effective()
        if value != self._effective:
            self._effective = value
            self.budgetChanged.emit(value)
