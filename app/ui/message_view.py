"""The conversation view: one `MessageWidget` per message in a scroll area. Prose renders as markdown;
fenced code gets a monospace `CodeBlock` with its own copy button; each message has a copy button.
Streamed text is buffered and re-rendered at most every `RENDER_MS`, so fast streams stay smooth."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QFontDatabase, QGuiApplication, QPixmap
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app import theme
from app.conversations import Message
from app.ui.markdown_segments import Segment, split_markdown

RENDER_MS = 50
_STATUS_TEXT = {"streaming": "answering…", "cancelled": "stopped", "interrupted": "interrupted: the engine stopped",
                "error": "failed"}


def _copy(text: str) -> None:
    QGuiApplication.clipboard().setText(text)


class CodeBlock(QFrame):
    MAX_LINES = 28

    def __init__(self, lang: str, text: str, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("CodeBlock")
        self.setStyleSheet("#CodeBlock { background: #0f1115; border: 1px solid #2c3038; border-radius: 6px; }")
        self.lang = QLabel(lang or "code")
        self.lang.setStyleSheet(f"color: {theme.MUTED}; font-size: 9pt;")
        copy = QToolButton()
        copy.setText("Copy")
        copy.setAutoRaise(True)
        copy.clicked.connect(lambda: _copy(self.body.toPlainText()))
        self.copy_button = copy
        head = QHBoxLayout()
        head.setContentsMargins(8, 2, 4, 0)
        head.addWidget(self.lang)
        head.addStretch(1)
        head.addWidget(copy)
        self.body = QPlainTextEdit()
        self.body.setReadOnly(True)
        self.body.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.body.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.body.setFrameShape(QFrame.Shape.NoFrame)
        self.body.setStyleSheet("background: transparent;")
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 4)
        layout.setSpacing(0)
        layout.addLayout(head)
        layout.addWidget(self.body)
        self.set_text(lang, text)

    def set_text(self, lang: str, text: str) -> None:
        self.lang.setText(lang or "code")
        if self.body.toPlainText() != text:
            self.body.setPlainText(text)
        lines = min(max(1, text.count("\n") + 1), self.MAX_LINES)
        metrics = self.body.fontMetrics()
        self.body.setFixedHeight(int(lines * metrics.lineSpacing() + 12 + metrics.height() * 0.6))


class MessageWidget(QFrame):
    def __init__(self, message: Message, assistant_name: str = "Assistant", parent: QWidget | None = None):
        super().__init__(parent)
        self.message_id = message.id
        self.role = message.role
        self.text = message.content
        self.setObjectName("MessageWidget")
        bg = "#263042" if self.role == "user" else theme.PANEL
        self.setStyleSheet(f"#MessageWidget {{ background: {bg}; border-radius: 8px; }}")
        self.who = QLabel("You" if self.role == "user" else assistant_name)
        self.who.setStyleSheet(f"font-weight: 600; color: {theme.ACCENT if self.role != 'user' else theme.TEXT};")
        self.status = QLabel()
        self.status.setStyleSheet(f"color: {theme.MUTED}; font-size: 9pt;")
        copy = QToolButton()
        copy.setText("Copy")
        copy.setAutoRaise(True)
        copy.setToolTip("Copy this message")
        copy.clicked.connect(lambda: _copy(self.text))
        self.copy_button = copy
        head = QHBoxLayout()
        head.addWidget(self.who)
        head.addWidget(self.status)
        head.addStretch(1)
        head.addWidget(copy)
        self.body = QVBoxLayout()
        self.body.setSpacing(6)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 6, 12, 10)
        layout.addLayout(head)
        if message.images:
            layout.addLayout(self._thumbnails(message.images))
        layout.addLayout(self.body)
        self._parts: list[tuple[str, QWidget]] = []
        self.set_text(message.content)
        self.set_status(message.status)

    def _thumbnails(self, paths: list[str]) -> QHBoxLayout:
        row = QHBoxLayout()
        for path in paths:
            label = QLabel()
            pix = QPixmap(path)
            if pix.isNull():
                label.setText(f"[image missing: {path}]")
            else:
                label.setPixmap(pix.scaled(160, 120, Qt.AspectRatioMode.KeepAspectRatio,
                                           Qt.TransformationMode.SmoothTransformation))
            row.addWidget(label)
        row.addStretch(1)
        return row

    def set_status(self, status: str) -> None:
        self.status.setText(_STATUS_TEXT.get(status, ""))

    def set_text(self, text: str) -> None:
        self.text = text
        if self.role == "user":
            segments = [Segment("text", text)]
        else:
            segments = split_markdown(text) or [Segment("text", "")]
        for i, seg in enumerate(segments):
            if i < len(self._parts) and self._parts[i][0] == seg.kind:
                self._update(self._parts[i][1], seg)
                continue
            for _, widget in self._parts[i:]:
                widget.deleteLater()
            del self._parts[i:]
            widget = self._make(seg)
            self.body.addWidget(widget)
            self._parts.append((seg.kind, widget))
        for _, widget in self._parts[len(segments):]:
            widget.deleteLater()
        del self._parts[len(segments):]

    def _make(self, seg: Segment) -> QWidget:
        if seg.kind == "code":
            return CodeBlock(seg.lang, seg.text)
        label = QLabel()
        label.setWordWrap(True)
        label.setTextFormat(Qt.TextFormat.PlainText if self.role == "user" else Qt.TextFormat.MarkdownText)
        label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        label.setOpenExternalLinks(True)
        label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
        label.setText(seg.text)
        return label

    @staticmethod
    def _update(widget: QWidget, seg: Segment) -> None:
        if isinstance(widget, CodeBlock):
            widget.set_text(seg.lang, seg.text)
        elif isinstance(widget, QLabel) and widget.text() != seg.text:
            widget.setText(seg.text)


class MessageList(QScrollArea):
    """All messages of the open conversation; `append_text` is the streaming path."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self._inner = QWidget()
        self._layout = QVBoxLayout(self._inner)
        self._layout.setContentsMargins(12, 12, 12, 12)
        self._layout.setSpacing(10)
        self._layout.addStretch(1)
        self.setWidget(self._inner)
        self.widgets: dict[int, MessageWidget] = {}
        self.assistant_name = "Assistant"
        self._pending: set[int] = set()
        self._render = QTimer(self)
        self._render.setSingleShot(True)
        self._render.setInterval(RENDER_MS)
        self._render.timeout.connect(self._flush)
        self._texts: dict[int, str] = {}
        self.empty_hint = QLabel("Ask anything. Drop or paste an image to ask a vision-language model about it.")
        self.empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.empty_hint.setStyleSheet(f"color: {theme.MUTED};")
        self._layout.insertWidget(0, self.empty_hint)

    def clear(self) -> None:
        for w in self.widgets.values():
            w.deleteLater()
        self.widgets.clear()
        self._texts.clear()
        self._pending.clear()
        self.empty_hint.show()

    def set_messages(self, messages: list[Message]) -> None:
        self.clear()
        for m in messages:
            self.add_message(m)
        QTimer.singleShot(0, self, self.scroll_to_bottom)

    def add_message(self, message: Message) -> MessageWidget:
        self.empty_hint.hide()
        widget = MessageWidget(message, self.assistant_name)
        self._layout.insertWidget(self._layout.count() - 1, widget)
        self.widgets[message.id] = widget
        self._texts[message.id] = message.content
        QTimer.singleShot(0, self, self.scroll_to_bottom)
        return widget

    def append_text(self, message_id: int, piece: str) -> None:
        if message_id not in self.widgets:
            return
        self._texts[message_id] = self._texts.get(message_id, "") + piece
        self._pending.add(message_id)
        if not self._render.isActive():
            self._render.start()

    def set_status(self, message_id: int, status: str) -> None:
        self._flush()
        widget = self.widgets.get(message_id)
        if widget is not None:
            widget.set_status(status)

    def text_of(self, message_id: int) -> str:
        """The text received so far (rendered or about to be)."""
        return self._texts.get(message_id, "")

    def _flush(self) -> None:
        follow = self._at_bottom()
        for mid in self._pending:
            widget = self.widgets.get(mid)
            if widget is not None:
                widget.set_text(self._texts[mid])
                widget.updateGeometry()
        self._pending.clear()
        self._layout.activate()
        if follow:
            QTimer.singleShot(0, self, self.scroll_to_bottom)

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 40

    def scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())
