"""`TrayMenu`: the Slipstream menu (open chat, budget mode, unload, settings, quit) and the tray icon
that shows it. Where the desktop has no system tray, `available` is False and the app shows the chat
window as a normal window with this menu in its menu bar instead."""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QAction, QActionGroup
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from app.icons import app_icon

BUDGET_MODES = (("auto", "Auto (follow free VRAM)"), ("fixed", "Fixed cap"),
                ("pause_when_gaming", "Pause while gaming"))


class TrayMenu(QObject):
    openChat = Signal()
    modeChosen = Signal(str)
    unloadRequested = Signal()
    reloadRequested = Signal()
    settingsRequested = Signal()
    quitRequested = Signal()

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.menu = QMenu("Slipstream")
        self.status_action = self.menu.addAction("Starting…")
        self.status_action.setEnabled(False)
        self.menu.addSeparator()
        self.menu.addAction("Open chat", self.openChat)
        budget = self.menu.addMenu("VRAM budget")
        self.mode_group = QActionGroup(self)
        self.mode_actions: dict[str, QAction] = {}
        for mode, label in BUDGET_MODES:
            action = budget.addAction(label)
            action.setCheckable(True)
            action.triggered.connect(lambda _=False, m=mode: self.modeChosen.emit(m))
            self.mode_group.addAction(action)
            self.mode_actions[mode] = action
        self.unload_action = self.menu.addAction("Unload model", self._unload_or_load)
        self.menu.addAction("Settings…", self.settingsRequested)
        self.menu.addSeparator()
        self.menu.addAction("Quit Slipstream", self.quitRequested)
        self.available = QSystemTrayIcon.isSystemTrayAvailable()
        self.icon: QSystemTrayIcon | None = None
        self._loaded = False
        if self.available:
            self.icon = QSystemTrayIcon(app_icon("loading"), self)
            self.icon.setContextMenu(self.menu)
            self.icon.setToolTip("Slipstream")
            self.icon.activated.connect(self._activated)

    def show(self) -> None:
        if self.icon is not None:
            self.icon.show()

    def hide(self) -> None:
        if self.icon is not None:
            self.icon.hide()

    def set_status(self, text: str, state: str = "idle") -> None:
        self.status_action.setText(text)
        if self.icon is not None:
            self.icon.setToolTip(f"Slipstream — {text}")
            self.icon.setIcon(app_icon(state))

    def set_mode(self, mode: str) -> None:
        action = self.mode_actions.get(mode)
        if action is not None:
            action.setChecked(True)

    def set_loaded(self, loaded: bool) -> None:
        self._loaded = loaded
        self.unload_action.setText("Unload model" if loaded else "Load model")

    def notify(self, title: str, message: str) -> None:
        if self.icon is not None and self.icon.supportsMessages():
            self.icon.showMessage(title, message, QSystemTrayIcon.MessageIcon.Warning, 5000)

    def _unload_or_load(self) -> None:
        (self.unloadRequested if self._loaded else self.reloadRequested).emit()

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason in (QSystemTrayIcon.ActivationReason.Trigger, QSystemTrayIcon.ActivationReason.DoubleClick):
            self.openChat.emit()
