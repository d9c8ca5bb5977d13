"""The composer under the conversation: the prompt box (Enter sends, Shift+Enter breaks the line; paste
or drop an image), the attached images, and the Send / Stop buttons."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QMimeData, Qt, Signal
from PySide6.QtGui import QImage, QKeyEvent, QPixmap
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)


class PromptEdit(QPlainTextEdit):
    submit = Signal()
    imagePasted = Signal(QImage)
    filesDropped = Signal(list)       # local file paths

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setPlaceholderText("Message Slipstream…  (Enter sends, Shift+Enter for a new line)")
        self.setMaximumHeight(140)
        self.setTabChangesFocus(True)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and \
                not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submit.emit()
            return
        super().keyPressEvent(event)

    def canInsertFromMimeData(self, source: QMimeData) -> bool:
        return source.hasImage() or source.hasUrls() or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source: QMimeData) -> None:
        if source.hasUrls() and any(u.isLocalFile() for u in source.urls()):
            self.filesDropped.emit([u.toLocalFile() for u in source.urls() if u.isLocalFile()])
        elif source.hasImage():
            image = QImage(source.imageData())
            if not image.isNull():
                self.imagePasted.emit(image)
        else:
            super().insertFromMimeData(source)


class AttachmentStrip(QWidget):
    """Thumbnails of the images that go with the next message; each can be removed."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.paths: list[str] = []
        self._layout = QHBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.addStretch(1)
        self.hide()

    def add(self, path: str) -> None:
        if path in self.paths:
            return
        self.paths.append(path)
        chip = QWidget()
        row = QHBoxLayout(chip)
        row.setContentsMargins(0, 0, 0, 0)
        thumb = QLabel()
        pix = QPixmap(path)
        if not pix.isNull():
            thumb.setPixmap(pix.scaled(56, 56, Qt.AspectRatioMode.KeepAspectRatio,
                                       Qt.TransformationMode.SmoothTransformation))
        thumb.setToolTip(Path(path).name)
        remove = QToolButton()
        remove.setText("✕")
        remove.setAutoRaise(True)
        remove.clicked.connect(lambda: self._remove(path, chip))
        row.addWidget(thumb)
        row.addWidget(remove)
        self._layout.insertWidget(self._layout.count() - 1, chip)
        self.show()
        self.changed.emit()

    def _remove(self, path: str, chip: QWidget) -> None:
        if path in self.paths:
            self.paths.remove(path)
        chip.deleteLater()
        self.setVisible(bool(self.paths))
        self.changed.emit()

    def take(self) -> list[str]:
        paths, self.paths = self.paths, []
        while self._layout.count() > 1:
            item = self._layout.takeAt(0)
            if item.widget():
                item.widget().deleteLater()
        self.hide()
        return paths


class Composer(QWidget):
    sendRequested = Signal(str)
    stopRequested = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.edit = PromptEdit()
        self.attachments = AttachmentStrip()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.send_button.clicked.connect(self._send)
        self.edit.submit.connect(self._send)
        self.stop_button.clicked.connect(self.stopRequested)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        row = QHBoxLayout()
        row.addWidget(self.edit, 1)
        row.addLayout(buttons)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 4, 12, 8)
        layout.addWidget(self.attachments)
        layout.addLayout(row)

    def set_generating(self, generating: bool) -> None:
        self.stop_button.setEnabled(generating)
        self.send_button.setEnabled(not generating)

    def _send(self) -> None:
        if not self.send_button.isEnabled():
            return
        text = self.edit.toPlainText().strip()
        if text or self.attachments.paths:
            self.sendRequested.emit(text)

    def clear_input(self) -> None:
        self.edit.clear()
