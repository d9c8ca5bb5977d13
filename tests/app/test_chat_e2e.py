"""End to end through a real engine worker process on a tiny model: streaming, stop, budget slider and
plan view, worker restart with the history intact, dropped files."""

from __future__ import annotations

import os
import signal

from PySide6.QtCore import QMimeData, QPointF, Qt, QUrl
from PySide6.QtGui import QDropEvent

from tests.app.conftest import pid_alive

TIMEOUT = 60_000


def _answer_id(ctl) -> int:
    return next(iter(ctl.session.active.values()))[1]


def test_window_is_usable_while_the_model_loads(qtbot, tiny_model_dir, memory_keyring):
    from app.controller import AppController, LaunchOptions

    ctl = AppController(LaunchOptions(show_chat=True, model=str(tiny_model_dir), device="sim", start_monitor=False))
    qtbot.addWidget(ctl.window)
    ctl.start()                       # returns at once: the worker starts and loads in the background
    assert ctl.window.isVisible()
    assert ctl.window.windowTitle().startswith("Slipstream")
    assert ctl.worker.state in ("starting", "loading")
    assert ctl.window.progress.isVisible()
    assert ctl.window.composer.send_button.isEnabled()
    qtbot.waitUntil(lambda: ctl.worker.state == "loaded", timeout=90_000)
    assert not ctl.window.progress.isVisible()
    ctl.quit()


def test_sending_a_message_streams_tokens_into_the_view(qtbot, controller):
    ctl = controller
    ctl.window.composer.edit.setPlainText("Hello there")
    qtbot.mouseClick(ctl.window.composer.send_button, Qt.MouseButton.LeftButton)
    assert ctl.session.generating
    answer = _answer_id(ctl)
    view = ctl.window.messages
    qtbot.waitUntil(lambda: len(view.text_of(answer)) > 0, timeout=TIMEOUT)
    first = view.text_of(answer)
    qtbot.waitUntil(lambda: len(view.text_of(answer)) > len(first), timeout=TIMEOUT)
    # Written to the database as it streams, not at the end.
    assert ctl.session.generating
    assert ctl.store.message(answer).content.startswith(first)
    assert ctl.store.message(answer).status == "streaming"
    qtbot.waitUntil(lambda: not ctl.session.generating, timeout=TIMEOUT)
    saved = ctl.store.message(answer)
    assert saved.status == "complete"
    assert saved.content == view.text_of(answer)
    qtbot.waitUntil(lambda: view.widgets[answer].text == saved.content, timeout=5_000)   # rendered
    titles = [c.title for c in ctl.store.list()]
    assert titles == ["Hello there"]
    assert len(ctl.window.charts.ttft.values) == 1


def test_stop_cancels_the_answer(qtbot, controller):
    ctl = controller
    ctl.window.composer.edit.setPlainText("Tell me a long story")
    ctl.window.composer.send_button.click()
    answer = _answer_id(ctl)
    qtbot.waitUntil(lambda: len(ctl.window.messages.text_of(answer)) > 0, timeout=TIMEOUT)
    assert ctl.window.composer.stop_button.isEnabled()
    with qtbot.waitSignal(ctl.worker.done, timeout=TIMEOUT) as blocker:
        qtbot.mouseClick(ctl.window.composer.stop_button, Qt.MouseButton.LeftButton)
    _rid, reason, stats = blocker.args
    assert reason == "cancelled"
    assert stats["generated_tokens"] < ctl.settings.max_new_tokens
    assert ctl.store.message(answer).status == "cancelled"
    assert ctl.window.messages.widgets[answer].status.text() == "stopped"
    assert not ctl.window.composer.stop_button.isEnabled()
    assert ctl.window.composer.send_button.isEnabled()


def test_budget_slider_replans_the_engine_and_the_plan_view_updates(qtbot, controller):
    ctl = controller
    chart = ctl.window.charts.plan
    before = dict(ctl.state.plan_report["tiers"][-1])
    marks = len(chart.marks)
    panel = ctl.window.budget
    target_fraction = 0.05
    with qtbot.waitSignal(ctl.worker.plan, timeout=5_000,
                          check_params_cb=lambda report, reason: reason == "budget") as blocker:
        panel.slider.setValue(int(panel.slider.maximum() * target_fraction))    # as a drag would
    report, _reason = blocker.args
    assert ctl.budget.mode == "fixed" and ctl.tray.mode_actions["fixed"].isChecked()
    cap = ctl.budget.cap
    assert report["budget"] == cap
    assert all(t["vram"]["total"] <= cap for t in report["tiers"])
    assert ctl.state.plan_report["budget"] == cap
    assert len(chart.marks) == marks + 1 and "budget" in chart.marks[-1][1]
    largest = report["tiers"][-1]
    assert chart.current[largest["tokens"]][0] == largest["plan"]
    assert (largest["plan"], largest["vram"]["total"]) != (before["plan"], before["vram"]["total"])
    ctl.window.charts.redraw()
    assert "budget" in chart.caption
    assert ctl.settings.budget_cap == cap


def test_budget_change_mid_answer_is_applied_live(qtbot, controller):
    ctl = controller
    ctl.window.composer.edit.setPlainText("Count to fifty")
    ctl.window.composer.send_button.click()
    answer = _answer_id(ctl)
    qtbot.waitUntil(lambda: len(ctl.window.messages.text_of(answer)) > 0, timeout=TIMEOUT)
    with qtbot.waitSignal(ctl.worker.plan, timeout=5_000,
                          check_params_cb=lambda report, reason: reason == "budget") as blocker:
        ctl.set_budget_cap(200_000)
    assert blocker.args[0]["budget"] == 200_000
    assert ctl.session.generating            # the answer goes on
    ctl.session.stop()
    qtbot.waitUntil(lambda: not ctl.session.generating, timeout=TIMEOUT)


def test_killed_worker_is_restarted_and_the_history_stays(qtbot, controller):
    ctl = controller
    ctl.window.composer.edit.setPlainText("First question")
    ctl.window.composer.send_button.click()
    qtbot.waitUntil(lambda: not ctl.session.generating, timeout=TIMEOUT)
    ctl.window.composer.edit.setPlainText("Second question")
    ctl.window.composer.send_button.click()
    answer = _answer_id(ctl)
    qtbot.waitUntil(lambda: len(ctl.window.messages.text_of(answer)) > 0, timeout=TIMEOUT)
    pid = ctl.worker.pid()
    with qtbot.waitSignal(ctl.worker.died, timeout=TIMEOUT) as died:
        os.kill(pid, signal.SIGKILL)
    assert "stopped unexpectedly" in died.args[0]
    assert "stopped unexpectedly" in ctl.window.notice.text()
    qtbot.waitUntil(lambda: not ctl.session.generating, timeout=TIMEOUT)
    partial = ctl.store.message(answer)
    assert partial.status == "interrupted" and partial.content           # what streamed is kept
    qtbot.waitUntil(lambda: ctl.worker.state == "loaded", timeout=90_000)   # restarted, model reloaded
    assert ctl.worker.pid() != pid and not pid_alive(pid)
    cid = ctl.session.conversation_id
    roles = [m.role for m in ctl.store.messages(cid)]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert len(ctl.window.messages.widgets) == 4
    # The conversation goes on with the new worker, history included.
    ctl.window.composer.edit.setPlainText("Third question")
    ctl.window.composer.send_button.click()
    qtbot.waitUntil(lambda: not ctl.session.generating, timeout=TIMEOUT)
    messages = ctl.store.messages(cid)
    assert [m.content for m in messages[:3]][::2] == ["First question", "Second question"]
    assert messages[-1].status == "complete" and messages[-1].content


def _drop(window, paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    event = QDropEvent(QPointF(50, 50), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                       Qt.KeyboardModifier.NoModifier)
    window.dropEvent(event)


def test_dropping_a_non_image_file_gives_a_clear_message(qtbot, controller, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    _drop(controller.window, [notes])
    text = controller.window.notice.text()
    assert "notes.txt is not an image" in text and "PNG" in text
    assert controller.window.composer.attachments.paths == []


def test_dropping_an_image_on_a_text_only_model_names_models_that_can_see(qtbot, controller, tmp_path):
    from PySide6.QtGui import QColor, QImage

    image = QImage(32, 32, QImage.Format.Format_RGB32)
    image.fill(QColor("red"))
    path = tmp_path / "red.png"
    assert image.save(str(path))
    _drop(controller.window, [path])
    text = controller.window.notice.text()
    assert "text-only model" in text and "vision-language" in text and "Qwen2.5-VL" in text
    assert controller.window.composer.attachments.paths == []
