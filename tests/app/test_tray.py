"""The tray menu's actions, and the normal-window fallback where no system tray exists (offscreen)."""

from __future__ import annotations

from app import paths
from app.settings import load_settings


def test_tray_menu_and_fallback_window(qtbot, memory_keyring):
    from app.controller import AppController, LaunchOptions

    ctl = AppController(LaunchOptions(start_monitor=False))
    qtbot.addWidget(ctl.window)
    texts = [a.text() for a in ctl.tray.menu.actions() if a.text()]
    assert texts[1:] == ["Open chat", "VRAM budget", "Unload model", "Settings…", "Quit Slipstream"]
    assert list(ctl.tray.mode_actions) == ["auto", "fixed", "pause_when_gaming"]
    # Offscreen there is no system tray: the chat window carries the menu and is the app.
    assert not ctl.tray.available
    assert ctl.tray.menu.menuAction() in ctl.window.menuBar().actions()
    ctl.tray.mode_actions["pause_when_gaming"].trigger()
    assert ctl.budget.mode == "pause_when_gaming"
    assert ctl.window.budget.buttons["pause_when_gaming"].isChecked()
    assert load_settings(paths.settings_file())[0].budget_mode == "pause_when_gaming"
    ctl.tray.openChat.emit()
    assert ctl.window.isVisible()
    ctl.store.close()
