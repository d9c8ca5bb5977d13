"""Drive the real app (bundled SmolLM2-135M, engine on the simulated accelerator) and save screenshots:
the chat window mid-answer, the budget panel and charts after budget changes, and the tray menu; then the
app as a first run opens it (device and backend on auto: llama.cpp on a machine without a GPU) after one
answer.

Run under an X server with a system tray (see take_screenshots.sh); writes PNGs next to this file.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QPoint
from PySide6.QtWidgets import QApplication

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from app.controller import AppController, LaunchOptions  # noqa: E402
from app.icons import app_icon  # noqa: E402
from app.theme import apply_theme  # noqa: E402


def wait_until(cond, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        QApplication.processEvents()
        time.sleep(0.02)


def pause(seconds: float) -> None:
    wait_until(lambda t=time.monotonic() + seconds: time.monotonic() > t, seconds + 1, "pause")


def ask(ctl: AppController, text: str) -> int:
    ctl.window.composer.edit.setPlainText(text)
    ctl.window.composer.send_button.click()
    return next(iter(ctl.session.active.values()))[1]


def main() -> int:
    app = QApplication(sys.argv[:1])
    app.setApplicationName("Slipstream")
    app.setWindowIcon(app_icon())
    apply_theme(app)
    ctl = AppController(LaunchOptions(show_chat=True, device="sim", backend="torch"))
    ctl.settings.max_new_tokens = 200
    ctl.settings.temperature = 0.0
    ctl.window.setGeometry(10, 40, 1580, 940)
    ctl.start()
    wait_until(lambda: ctl.worker.state == "loaded", 300, "the model to load")
    pause(2)

    ask(ctl, "In one sentence: what is VRAM?")
    wait_until(lambda: not ctl.session.generating, 120, "the first answer")
    ctl.new_conversation()
    answer = ask(ctl, "Write a Python function that reverses a string, with a short explanation.")
    view = ctl.window.messages
    need = max(t["vram"]["total"] for t in ctl.state.plan_report["tiers"])
    wait_until(lambda: len(view.text_of(answer)) > 20, 120, "the answer to start")
    ctl.window.budget.set_cap(int(need * 0.6))          # as a drag of the slider would, mid-answer
    pause(1.5)
    ctl.window.budget.set_cap(int(need * 0.35))
    wait_until(lambda: view.text_of(answer).count("```") >= 2 and len(view.text_of(answer)) > 160
               or not ctl.session.generating, 120, "a code block and some prose")
    pause(0.2)
    ctl.window.grab().save(str(HERE / "chat-mid-answer.png"))
    print("chat-mid-answer.png: generating =", ctl.session.generating)
    wait_until(lambda: not ctl.session.generating, 180, "the answer to end")
    pause(1)
    ctl.window.budget.set_cap(int(need * 0.8))
    pause(2.5)
    ctl.window.side.grab().save(str(HERE / "charts-budget-change.png"))

    ctl.tray.set_status(ctl.tray.status_action.text(), "idle")
    screen = app.primaryScreen()
    ctl.tray.menu.popup(QPoint(1320, 30))
    pause(0.8)
    budget_menu = next(a.menu() for a in ctl.tray.menu.actions() if a.menu() is not None)
    ctl.tray.menu.setActiveAction(budget_menu.menuAction())
    budget_menu.popup(ctl.tray.menu.geometry().topLeft() + QPoint(-budget_menu.sizeHint().width(), 40))
    pause(0.8)
    screen.grabWindow(0, 980, 0, 620, 330).save(str(HERE / "tray-menu.png"))
    ctl.quit()

    for var in ("SLIPSTREAM_DATA_DIR", "SLIPSTREAM_CONFIG_DIR"):  # a first run: no settings, no conversations
        os.environ[var] = tempfile.mkdtemp()
    first = AppController(LaunchOptions(show_chat=True))          # what `installers/dev.sh app` opens
    first.window.setGeometry(10, 40, 1580, 940)
    first.start()
    wait_until(lambda: first.worker.state == "loaded", 300, "the default backend to load the model")
    pause(1)
    ask(first, "Name three uses of a GPU besides games.")
    wait_until(lambda: not first.session.generating, 120, "the first run's answer")
    pause(2.5)
    first.window.grab().save(str(HERE / "first-run-default.png"))
    first.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
