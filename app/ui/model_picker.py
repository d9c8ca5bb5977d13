"""`ModelPicker`: a combo box of known models plus "Open GGUF file…" and "Open Hugging Face folder…"."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QFileDialog, QWidget

from app.model_catalog import ModelEntry, label_for

_OPEN_FILE = "__open_file__"
_OPEN_FOLDER = "__open_folder__"


class ModelPicker(QComboBox):
    modelChosen = Signal(object)      # source: str or None (bundled)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumWidth(260)
        self.setToolTip("The model to chat with")
        self._current: str | None = None
        self._updating = False
        self.activated.connect(self._activated)

    def set_entries(self, entries: list[ModelEntry], current: str | None) -> None:
        self._updating = True
        self.clear()
        for e in entries:
            self.addItem(e.label, e.source)
            self.setItemData(self.count() - 1, e.source or "bundled default", 3)   # tooltip role
        if current is not None and self.findData(current) < 0:
            self.addItem(label_for(current), current)
        self.insertSeparator(self.count())
        self.addItem("Open GGUF file…", _OPEN_FILE)
        self.addItem("Open Hugging Face folder…", _OPEN_FOLDER)
        self._updating = False
        self.set_current(current)

    def set_current(self, source: str | None) -> None:
        self._current = source
        index = self.findData(source)
        if index < 0 and source is not None:
            self.insertItem(0, label_for(source), source)
            index = 0
        if index >= 0:
            self.setCurrentIndex(index)

    def _activated(self, index: int) -> None:
        if self._updating:
            return
        data = self.itemData(index)
        if data == _OPEN_FILE:
            path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF models (*.gguf)")
            self.set_current(self._current)
            if path:
                self.choose(path)
        elif data == _OPEN_FOLDER:
            path = QFileDialog.getExistingDirectory(self, "Open a Hugging Face model folder")
            self.set_current(self._current)
            if path:
                self.choose(path)
        elif data != self._current:
            self.choose(data)

    def choose(self, source: str | None) -> None:
        self.set_current(source)
        self.modelChosen.emit(source)
