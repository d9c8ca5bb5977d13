"""`ConversationList`: the saved conversations, newest first, with New, Rename (edit in place) and Delete."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QHBoxLayout,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.conversations import Conversation


class ConversationList(QWidget):
    selected = Signal(int)
    newRequested = Signal()
    renamed = Signal(int, str)
    deleteRequested = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.list = QListWidget()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.customContextMenuRequested.connect(self._menu)
        self.list.currentItemChanged.connect(self._current_changed)
        self.list.itemChanged.connect(self._item_changed)
        new = QPushButton("New chat")
        new.clicked.connect(self.newRequested)
        rename = QPushButton("Rename")
        rename.clicked.connect(self.start_rename)
        delete = QPushButton("Delete")
        delete.clicked.connect(self._delete_current)
        buttons = QHBoxLayout()
        buttons.addWidget(rename)
        buttons.addWidget(delete)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 0, 8)
        layout.addWidget(new)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)
        self._filling = False
        self.confirm_delete = True

    def set_conversations(self, conversations: list[Conversation], current: int | None) -> None:
        self._filling = True
        self.list.clear()
        for c in conversations:
            item = QListWidgetItem(c.title)
            item.setData(Qt.ItemDataRole.UserRole, c.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            self.list.addItem(item)
            if c.id == current:
                self.list.setCurrentItem(item)
        self._filling = False

    def current_id(self) -> int | None:
        item = self.list.currentItem()
        return int(item.data(Qt.ItemDataRole.UserRole)) if item else None

    def start_rename(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            self.list.editItem(item)

    def _current_changed(self, item: QListWidgetItem | None, _previous) -> None:
        if item is not None and not self._filling:
            self.selected.emit(int(item.data(Qt.ItemDataRole.UserRole)))

    def _item_changed(self, item: QListWidgetItem) -> None:
        if not self._filling:
            self.renamed.emit(int(item.data(Qt.ItemDataRole.UserRole)), item.text())

    def _delete_current(self) -> None:
        cid = self.current_id()
        if cid is None:
            return
        if self.confirm_delete:
            title = self.list.currentItem().text()
            answer = QMessageBox.question(self, "Delete conversation", f"Delete “{title}”? This cannot be undone.")
            if answer != QMessageBox.StandardButton.Yes:
                return
        self.deleteRequested.emit(cid)

    def _menu(self, pos) -> None:
        if self.list.itemAt(pos) is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename", self.start_rename)
        menu.addAction("Delete", self._delete_current)
        menu.exec(self.list.mapToGlobal(pos))
