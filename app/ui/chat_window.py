"""`ChatWindow`: conversations on the left, the chat in the middle, the VRAM budget and live charts on
the right. The whole window takes dropped files and images. It only shows state and emits intents;
`app.controller.AppController` wires it to the worker and the store."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QCloseEvent, QDragEnterEvent, QDropEvent, QImage
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QProgressBar,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app import theme
from app.charts.panel import ChartsPanel
from app.live_state import LiveState
from app.ui.budget_panel import BudgetPanel
from app.ui.composer import Composer
from app.ui.conversation_list import ConversationList
from app.ui.message_view import MessageList
from app.ui.model_picker import ModelPicker
from app.ui.notice import NoticeBar

TITLE = "Slipstream — chat"


class ChatWindow(QMainWindow):
    filesDropped = Signal(list)
    imageDropped = Signal(QImage)
    closing = Signal()

    def __init__(self, state: LiveState, chart_window_s: float = 120.0, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle(TITLE)
        self.setAcceptDrops(True)
        self.resize(1360, 820)
        self.quit_on_close = False

        self.conversations = ConversationList()
        self.picker = ModelPicker()
        self.engine_label = QLabel("starting the engine…")
        self.engine_label.setStyleSheet(f"color: {theme.MUTED};")
        self.charts_button = QPushButton("Charts")
        self.charts_button.setCheckable(True)
        self.charts_button.setChecked(True)
        top = QHBoxLayout()
        top.setContentsMargins(12, 8, 12, 0)
        top.addWidget(QLabel("Model"))
        top.addWidget(self.picker)
        top.addWidget(self.engine_label, 1)
        top.addWidget(self.charts_button)
        self.notice = NoticeBar()
        self.messages = MessageList()
        self.composer = Composer()
        self.composer.edit.imagePasted.connect(self.imageDropped)
        self.composer.edit.filesDropped.connect(self.filesDropped)
        chat = QWidget()
        col = QVBoxLayout(chat)
        col.setContentsMargins(0, 0, 0, 0)
        col.addLayout(top)
        notice_row = QHBoxLayout()
        notice_row.setContentsMargins(12, 0, 12, 0)
        notice_row.addWidget(self.notice)
        col.addLayout(notice_row)
        col.addWidget(self.messages, 1)
        col.addWidget(self.composer)

        self.budget = BudgetPanel()
        self.charts = ChartsPanel(state, chart_window_s)
        side = QWidget()
        side_col = QVBoxLayout(side)
        side_col.setContentsMargins(0, 8, 8, 8)
        side_col.addWidget(self.budget)
        side_col.addWidget(self.charts, 1)
        self.side = side
        self.charts_button.toggled.connect(side.setVisible)

        split = QSplitter(Qt.Orientation.Horizontal)
        split.addWidget(self.conversations)
        split.addWidget(chat)
        split.addWidget(side)
        split.setStretchFactor(1, 3)
        split.setStretchFactor(2, 2)
        split.setSizes([220, 640, 500])
        self.setCentralWidget(split)

        self.state_label = QLabel("")
        self.speed_label = QLabel("")
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(220)
        self.progress.setTextVisible(False)
        self.progress.hide()
        bar = self.statusBar()
        bar.addWidget(self.state_label, 1)
        bar.addPermanentWidget(self.progress)
        bar.addPermanentWidget(self.speed_label)

    # ---- state shown ------------------------------------------------------------------------------
    def show_loading(self, message: str, fraction: float | None) -> None:
        self.state_label.setText(message)
        self.progress.show()
        if fraction is None or fraction <= 0.05:
            self.progress.setRange(0, 0)     # busy indicator: the engine gives no finer progress
        else:
            self.progress.setRange(0, 100)
            self.progress.setValue(int(fraction * 100))

    def hide_loading(self, message: str = "") -> None:
        self.progress.hide()
        self.state_label.setText(message)

    # ---- drops ------------------------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        mime = event.mimeData()
        if mime.hasUrls() or mime.hasImage():
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        mime = event.mimeData()
        paths = [u.toLocalFile() for u in mime.urls() if u.isLocalFile()] if mime.hasUrls() else []
        if paths:
            self.filesDropped.emit(paths)
        elif mime.hasImage():
            self.imageDropped.emit(QImage(mime.imageData()))
        event.acceptProposedAction()

    def closeEvent(self, event: QCloseEvent) -> None:
        self.closing.emit()
        super().closeEvent(event)
