"""`AppController`: builds the app's parts and wires them together — settings, secrets, conversation
store, the engine worker, the VRAM monitor, the budget, the chat window and the tray menu, and the
local OpenAI-compatible API, which the worker serves on the loaded model when Settings turn it on.

Launch never waits on the engine: the window is shown at once and the worker starts and loads the
model in the background, with progress in the status bar.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QApplication, QDialog

from app import attachments, paths
from app.budget import BudgetController
from app.chat_session import ChatSession
from app.conversations import ConversationStore
from app.format import format_bytes, format_rate, format_seconds
from app.live_state import LiveState
from app.model_catalog import discover_models, label_for
from app.monitor_bridge import MonitorBridge
from app.secret_store import SecretStore, SecretStoreError
from app.settings import Settings, load_settings, save_settings
from app.tray import TrayMenu
from app.ui.chat_window import ChatWindow
from app.ui.settings_dialog import SettingsDialog
from app.worker_client import WorkerClient, default_worker_command


def _disconnect(signal, slot) -> None:
    try:
        signal.disconnect(slot)
    except (RuntimeError, TypeError):
        pass   # already disconnected


@dataclass(slots=True)
class LaunchOptions:
    show_chat: bool = False
    model: str | None = None          # overrides the saved model for this run
    device: str | None = None
    backend: str | None = None
    worker_command: list[str] | None = None
    start_monitor: bool = True


class AppController(QObject):
    def __init__(self, options: LaunchOptions | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.options = options or LaunchOptions()
        self.settings, problems = load_settings(paths.settings_file())
        self.secrets = SecretStore()
        self.store = ConversationStore(paths.conversations_db())
        self.state = LiveState()
        self.model_source = self.options.model if self.options.model is not None else self.settings.model_source
        self.device = self.options.device or self.settings.device
        self.backend = self.options.backend or self.settings.backend
        self.worker = WorkerClient(self.options.worker_command or default_worker_command(), paths.worker_log(), self)
        self.monitor = MonitorBridge(self.settings.reserve, parent=self)
        self.budget = BudgetController(self.settings.budget_mode, self.settings.budget_cap, self)
        self.window = ChatWindow(self.state, self.settings.chart_window_s)
        self.tray = TrayMenu(self)
        self.session = ChatSession(self.store, self.worker, self.window.messages, self.settings, self)
        self._quitting = False
        self._hint_shown = False
        self._wire()
        for line in problems:
            self.window.notice.show_message(line, "warning")

    # ---- set-up -----------------------------------------------------------------------------------
    def _wire(self) -> None:
        w, worker = self.window, self.worker
        worker.stateChanged.connect(self._worker_state)
        worker.ready.connect(self._worker_ready)
        worker.loadProgress.connect(self._load_progress)
        worker.loaded.connect(self._loaded)
        worker.unloaded.connect(self._unloaded)
        worker.plan.connect(self._plan)
        worker.metrics.connect(self._metrics)
        worker.error.connect(self._worker_error)
        worker.died.connect(self._worker_died)
        self.session.generatingChanged.connect(self._generating)
        self.session.conversationsChanged.connect(self.refresh_conversations)
        self.session.finished.connect(self._finished)
        w.composer.sendRequested.connect(self.send)
        w.composer.stopRequested.connect(self.session.stop)
        w.filesDropped.connect(self.attach_paths)
        w.imageDropped.connect(self.attach_image)
        w.conversations.selected.connect(self.session.open)
        w.conversations.newRequested.connect(self.new_conversation)
        w.conversations.renamed.connect(self.rename_conversation)
        w.conversations.deleteRequested.connect(self.session.delete)
        w.picker.modelChosen.connect(self.load_model)
        w.budget.modeChanged.connect(self.set_budget_mode)
        w.budget.capChanged.connect(self.set_budget_cap)
        w.closing.connect(self._window_closing)
        self.budget.budgetChanged.connect(self._budget_changed)
        self.monitor.snapshot.connect(self._snapshot)
        self.monitor.budgetEvent.connect(self._budget_event)
        t = self.tray
        t.openChat.connect(self.show_chat)
        t.modeChosen.connect(self.set_budget_mode)
        t.unloadRequested.connect(self.unload_model)
        t.reloadRequested.connect(self.reload_model)
        t.settingsRequested.connect(self.open_settings)
        t.quitRequested.connect(self.quit)
        if not t.available:
            w.menuBar().addMenu(t.menu)   # no system tray: the window is the app, with the menu on top

    def start(self) -> None:
        """Show what there is to show now; start the worker, the monitor and the model load."""
        self.window.budget.set_mode(self.budget.mode)
        self.tray.set_mode(self.budget.mode)
        self.window.budget.show_cap(self.budget.cap)
        self.window.picker.set_entries(discover_models(self.settings.extra_model_dirs), self.model_source)
        self.refresh_conversations()
        convs = self.store.list()
        if convs:
            self.session.open(convs[0].id)
            self.window.conversations.set_conversations(convs, convs[0].id)
        self.tray.show()
        if self.options.show_chat or not self.tray.available:
            self.show_chat()
        if self.options.start_monitor:
            self.monitor.start()
            self.state.monitor_status = self.monitor.status
        self.state.budget = self.budget.effective()
        self.worker.set_budget(self.state.budget)
        self.worker.start()
        self.worker.load(self.model_source, self.device, self.backend)
        self.sync_api()

    # ---- windows ----------------------------------------------------------------------------------
    def show_chat(self) -> None:
        self.window.show()
        self.window.raise_()
        self.window.activateWindow()

    def _window_closing(self) -> None:
        if not self.tray.available:
            QTimer.singleShot(0, self, self.quit)
        elif not self._hint_shown and not self._quitting:
            self._hint_shown = True
            self.tray.notify("Slipstream", "Slipstream keeps running in the tray.")

    def settings_dialog(self) -> SettingsDialog:
        """The settings dialog, kept up to date with the API server's status while it is open."""
        dialog = SettingsDialog(self.settings, self.secrets, self.window, api_status=self.worker.api)
        self.worker.apiStatus.connect(dialog.show_api_status)
        return dialog

    def open_settings(self) -> None:
        dialog = self.settings_dialog()
        accepted = dialog.exec() == QDialog.DialogCode.Accepted
        _disconnect(self.worker.apiStatus, dialog.show_api_status)
        if accepted:
            problem = dialog.save_secrets()
            if problem:
                self.window.notice.show_message(problem, "error")
            self.apply_settings(dialog.result_settings())
        dialog.deleteLater()

    def apply_settings(self, new: Settings) -> None:
        """Save settings; reload the model when the device or backend changed."""
        problems = new.validate()
        reload_needed = (new.device, new.backend) != (self.settings.device, self.settings.backend)
        for name in Settings.__slots__:
            setattr(self.settings, name, getattr(new, name))
        save_settings(self.settings, paths.settings_file())
        self.monitor.set_reserve(self.settings.reserve)
        for line in problems:
            self.window.notice.show_message(line, "warning")
        self.window.picker.set_entries(discover_models(self.settings.extra_model_dirs), self.model_source)
        if reload_needed:
            self.device, self.backend = self.settings.device, self.settings.backend
            self.load_model(self.model_source)
        self.sync_api()

    # ---- the local API ----------------------------------------------------------------------------
    def sync_api(self) -> None:
        """Start (or restart, with the current port and key) or stop the worker's API server, as the
        settings say. The key comes from the keyring, created there on first use. A port in use comes back
        as a worker `error` (shown like any other) and in the dialog's address line."""
        if not self.settings.api_enabled:
            if self.worker.api.get("running") or self.worker.api_wanted:
                self.worker.api_stop()
            return
        try:
            key = self.secrets.ensure_api_key()
        except SecretStoreError as exc:
            self.window.notice.show_message(f"Local API not started: {exc}", "error")
            return
        self.worker.api_start(self.settings.api_port, key)

    # ---- conversations ----------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        self.window.conversations.set_conversations(self.store.list(), self.session.conversation_id)

    def new_conversation(self) -> None:
        self.session.new()

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self.refresh_conversations()

    def send(self, text: str) -> None:
        images = list(self.window.composer.attachments.paths)
        model = self.worker.model
        if images and model is not None and not model.get("vision"):
            self.window.notice.show_message(attachments.text_only_message(model.get("name", "This model")),
                                            "warning")
            return
        self.window.composer.attachments.take()
        self.window.composer.clear_input()
        self.session.send(text, images)

    # ---- images -----------------------------------------------------------------------------------
    def attach_paths(self, file_paths: list[str]) -> None:
        for path in file_paths:
            if not attachments.is_image(path):
                self.window.notice.show_message(attachments.not_an_image_message(path), "warning")
                continue
            if self._refuse_images():
                return
            self.window.composer.attachments.add(attachments.keep_copy(path, paths.attachments_dir()))

    def attach_image(self, image: QImage) -> None:
        if self._refuse_images():
            return
        saved = attachments.save_pasted(image, paths.attachments_dir())
        if saved:
            self.window.composer.attachments.add(saved)

    def _refuse_images(self) -> bool:
        model = self.worker.model
        if model is not None and not model.get("vision"):
            self.window.notice.show_message(attachments.text_only_message(model.get("name", "This model")),
                                            "warning")
            return True
        return False

    # ---- model ------------------------------------------------------------------------------------
    def load_model(self, source: str | None) -> None:
        self.model_source = source
        self.settings.model_source = source
        save_settings(self.settings, paths.settings_file())
        self.window.picker.set_current(source)
        self.window.show_loading(f"loading {label_for(source)}…", None)
        self.worker.load(source, self.device, self.backend)

    def reload_model(self) -> None:
        self.load_model(self.model_source)

    def unload_model(self) -> None:
        self.session.stop()
        self.worker.unload()

    def _loaded(self, event: dict) -> None:
        model = event.get("model") or {}
        self.state.plan_report = event.get("plan_report")
        name = model.get("name") or label_for(self.model_source)
        self.window.messages.assistant_name = name
        self.window.hide_loading(f"{name} loaded in {model.get('load_s', 0):.1f} s")
        self.window.engine_label.setText(f"{model.get('backend', '?')} on {model.get('device', '?')}"
                                         f" · context {model.get('context_length', '?')}")
        self.tray.set_loaded(True)
        self.tray.set_status(f"{name} ready", "idle")
        self._update_slider_range(model)
        self.window.charts.mark_replan("model loaded")
        self._show_plan_summary()

    def _unloaded(self) -> None:
        self.state.plan_report = None
        self.tray.set_loaded(False)
        self.tray.set_status("No model loaded", "paused")
        self.window.hide_loading("model unloaded: VRAM released")
        self.window.engine_label.setText("no model loaded")

    def _update_slider_range(self, model: dict) -> None:
        gpus = list(getattr(self.state.snapshot, "gpus", None) or [])
        if gpus:
            top = max(int(getattr(g, "total", 0) or 0) for g in gpus)
        else:
            tiers = (self.state.plan_report or {}).get("tiers") or []
            need = max([int((t.get("vram") or {}).get("total", 0)) for t in tiers] or [0])
            top = max(int(model.get("weights_bytes", 0) * 1.5), int(need * 1.25), 1 << 20)
        self.window.budget.set_range(top)
        self.window.budget.show_cap(self.budget.cap if self.budget.mode == "fixed" else self.state.budget)

    # ---- budget -----------------------------------------------------------------------------------
    def set_budget_mode(self, mode: str) -> None:
        self.budget.set_mode(mode)
        self.settings.budget_mode = mode
        save_settings(self.settings, paths.settings_file())
        self.window.budget.set_mode(mode)
        self.tray.set_mode(mode)
        self._show_plan_summary()

    def set_budget_cap(self, n_bytes: int) -> None:
        self.budget.set_cap(n_bytes)
        self.settings.budget_mode, self.settings.budget_cap = "fixed", int(n_bytes)
        save_settings(self.settings, paths.settings_file())
        self.window.budget.set_mode("fixed")
        self.tray.set_mode("fixed")

    def _budget_changed(self, value: int | None) -> None:
        self.state.budget = value
        self.worker.set_budget(value)
        if self.budget.mode != "fixed":
            self.window.budget.show_cap(value)
        self._show_plan_summary()

    def _snapshot(self, snap) -> None:
        self.state.snapshot = snap
        self.state.monitor_status = str(getattr(snap, "status", "") or "")
        self.budget.on_monitor(getattr(snap, "budget", None), bool(getattr(snap, "gaming", False)))

    def _budget_event(self, event) -> None:
        gaming = bool(getattr(self.state.snapshot, "gaming", False) or getattr(event, "paused", False))
        self.budget.on_monitor(getattr(event, "budget", None), gaming)

    def _plan(self, report: dict, reason: str) -> None:
        self.state.plan_report = report
        budget = report.get("budget")
        text = {"budget": f"budget → {format_bytes(budget) if budget is not None else 'engine decides'}",
                "forced": "plan forced", "engine": "engine re-planned"}.get(reason, reason)
        if reason != "requested":
            self.window.charts.mark_replan(text)
        self._show_plan_summary()

    def _show_plan_summary(self) -> None:
        report = self.state.plan_report or {}
        tiers = report.get("tiers") or []
        kinds = ", ".join(f"{t.get('tokens')}: {t.get('plan')}" for t in tiers[:4])
        mode = {"auto": "auto", "fixed": "fixed cap", "pause_when_gaming": "pause while gaming"}[self.budget.mode]
        paused = " · paused: a game is running" if self.budget.paused else ""
        budget = self.state.budget
        self.window.budget.status.setText(
            f"Mode: {mode}{paused} · budget {format_bytes(budget) if budget is not None else 'engine decides'}"
            + (f" · plan per tier {kinds}" if kinds else "") + f" · monitor: {self.state.monitor_status or 'off'}")

    # ---- worker -----------------------------------------------------------------------------------
    def _worker_state(self, state: str) -> None:
        icon = {"loading": "loading", "starting": "loading", "restarting": "loading", "failed": "error",
                "loaded": "idle", "ready": "paused"}.get(state, "idle")
        text = {"starting": "Starting the engine…", "loading": "Loading the model…",
                "restarting": "Restarting the engine…", "failed": "The engine stopped",
                "ready": "No model loaded"}.get(state)
        if text:
            self.tray.set_status(text, icon)
        if state in ("starting", "restarting"):
            self.window.show_loading(text or "", None)
        if state == "failed":
            self.window.hide_loading("engine stopped")

    def _worker_ready(self, _event: dict) -> None:
        self.monitor.set_own_pids([self.worker.pid() or 0])

    def _load_progress(self, event: dict) -> None:
        self.window.show_loading(str(event.get("message") or "loading…"), event.get("fraction"))

    def _metrics(self, ev: dict) -> None:
        self.state.set_metrics(ev)
        if isinstance(ev.get("own_vram"), int):
            self.monitor.set_own_vram(ev["own_vram"])
        if ev.get("generating"):
            self.window.speed_label.setText(format_rate(ev.get("tokens_per_s")))

    def _generating(self, generating: bool) -> None:
        self.state.generating = generating
        self.window.composer.set_generating(generating)
        if self.worker.model:
            self.tray.set_status(f"{self.worker.model.get('name')} {'answering' if generating else 'ready'}",
                                 "busy" if generating else "idle")

    def _finished(self, reason: str, stats: dict) -> None:
        self.window.charts.add_request(stats.get("ttft_s"))
        tps = stats.get("decode_tokens_per_s")
        n = stats.get("generated_tokens")
        if reason in ("eos", "length", "stop", "cancelled"):
            self.window.speed_label.setText(f"{n} tokens · {format_rate(tps)} · first token "
                                            f"{format_seconds(stats.get('ttft_s'))}")
        self.refresh_conversations()

    def _worker_error(self, rid, message: str, kind: str) -> None:
        if kind == "load":
            self.window.hide_loading("loading failed")
            self.window.notice.show_message(f"Could not load the model: {message}", "error")
            self.tray.set_status("Loading failed", "error")
        else:
            self.window.notice.show_message(message, "error")

    def _worker_died(self, message: str) -> None:
        self.window.notice.show_message(message, "warning" if self.worker.state != "failed" else "error")
        self.tray.notify("Slipstream", message)

    # ---- quit -------------------------------------------------------------------------------------
    def quit(self) -> None:
        if self._quitting:
            return
        self._quitting = True
        self.session.stop()
        self.worker.shutdown()
        self.monitor.stop()
        self.tray.hide()
        self.window.close()
        self.store.close()
        app = QApplication.instance()
        if app is not None:
            app.quit()
