"""`NoticeBar`: a one-line message above the chat (info, warning or error) with a close button."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QWidget

_COLORS = {"info": "#23405a", "warning": "#5a4320", "error": "#5a2424"}


class NoticeBar(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(close, 0, Qt.AlignmentFlag.AlignTop)
        self.level = "info"
        self.hide()

    def show_message(self, text: str, level: str = "info") -> None:
        self.level = level
        self.label.setText(text)
        self.setStyleSheet(f"NoticeBar {{ background: {_COLORS.get(level, _COLORS['info'])}; border-radius: 6px; }}")
        self.show()

    def text(self) -> str:
        return self.label.text() if self.isVisible() else ""
