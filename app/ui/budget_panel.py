"""`BudgetPanel`: the VRAM budget mode (auto / fixed cap / pause while gaming) and the cap slider.

Dragging the slider emits `capChanged` as it moves (at most every `EMIT_MS`), so the engine re-plans
live; the plan chart shows the result within a second."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QRadioButton,
    QSlider,
    QWidget,
)

from app import theme
from app.format import format_bytes

STEPS = 1000
EMIT_MS = 80
MODES = (("auto", "Auto"), ("fixed", "Fixed cap"), ("pause_when_gaming", "Pause while gaming"))


class BudgetPanel(QGroupBox):
    modeChanged = Signal(str)
    capChanged = Signal(int)           # bytes

    def __init__(self, parent: QWidget | None = None):
        super().__init__("VRAM budget", parent)
        self.max_bytes = 8 << 30
        self.group = QButtonGroup(self)
        modes = QHBoxLayout()
        self.buttons: dict[str, QRadioButton] = {}
        for i, (mode, label) in enumerate(MODES):
            button = QRadioButton(label)
            self.group.addButton(button, i)
            self.buttons[mode] = button
            modes.addWidget(button)
        modes.addStretch(1)
        self.group.idClicked.connect(lambda i: self.modeChanged.emit(MODES[i][0]))
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, STEPS)
        self.slider.setPageStep(STEPS // 20)
        self.slider.valueChanged.connect(self._moved)
        self.value_label = QLabel()
        self.value_label.setMinimumWidth(90)
        self.value_label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.status = QLabel("")
        self.status.setStyleSheet(f"color: {theme.MUTED};")
        self.status.setWordWrap(True)
        grid = QGridLayout(self)
        grid.addLayout(modes, 0, 0, 1, 2)
        grid.addWidget(self.slider, 1, 0)
        grid.addWidget(self.value_label, 1, 1)
        grid.addWidget(self.status, 2, 0, 1, 2)
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(EMIT_MS)
        self._timer.timeout.connect(self._emit_cap)
        self._quiet = False

    def set_range(self, max_bytes: int) -> None:
        cap = self.cap_bytes()
        self.max_bytes = max(1, int(max_bytes))
        self.show_cap(min(cap, self.max_bytes))

    def set_mode(self, mode: str) -> None:
        button = self.buttons.get(mode)
        if button is not None and not button.isChecked():
            button.setChecked(True)

    def show_cap(self, n_bytes: int | None) -> None:
        """Move the slider without emitting (the budget came from elsewhere)."""
        self._quiet = True
        if n_bytes is not None:
            self.slider.setValue(round(STEPS * min(n_bytes, self.max_bytes) / self.max_bytes))
        else:
            self.slider.setValue(STEPS)      # no limit from us: the engine decides
        self.value_label.setText(format_bytes(n_bytes) if n_bytes is not None else "engine decides")
        self._quiet = False

    def set_cap(self, n_bytes: int) -> None:
        """Move the slider as the user would (emits `capChanged`)."""
        self.slider.setValue(round(STEPS * min(max(0, n_bytes), self.max_bytes) / self.max_bytes))

    def cap_bytes(self) -> int:
        return int(self.max_bytes * self.slider.value() / STEPS)

    def _moved(self, _value: int) -> None:
        self.value_label.setText(format_bytes(self.cap_bytes()))
        if not self._quiet and not self._timer.isActive():
            self._timer.start()

    def _emit_cap(self) -> None:
        self.capChanged.emit(self.cap_bytes())
