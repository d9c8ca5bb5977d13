"""`WorkerClient`: starts the engine worker with QProcess and turns its events into Qt signals.

Nothing here blocks the UI thread: the process starts asynchronously, output arrives through
`readyReadStandardOutput`. Requests written before the worker said `ready` wait in a queue. If the
worker dies unexpectedly, `died` says so, a running generation ends as "interrupted", and the worker is
started again and the last model reloaded (with the current budget), and the local API server started
again where it ran. More than `MAX_RESTARTS` deaths within a minute stop the restarts and say so.
"""

from __future__ import annotations

import collections
import itertools
import os
import sys
import time
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from app.worker_protocol import PROTOCOL_VERSION, LineDecoder, encode_request

MAX_RESTARTS = 3
RESTART_DELAY_MS = 300
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


def default_worker_command(pace_ms: float = 0.0) -> list[str]:
    cmd = [sys.executable, "-m", "engine", "worker"]
    if pace_ms:
        cmd += ["--pace-ms", str(pace_ms)]
    return cmd


class WorkerClient(QObject):
    stateChanged = Signal(str)          # starting | ready | loading | loaded | restarting | failed | stopped
    ready = Signal(dict)
    loadProgress = Signal(dict)
    loaded = Signal(dict)               # the `loaded` event: {"model": {...}, "plan_report": {...}}
    unloaded = Signal()
    token = Signal(str, str)            # request id, text
    done = Signal(str, str, dict)       # request id, finish_reason, stats
    error = Signal(object, str, str)    # request id or None, message, kind
    plan = Signal(dict, str)            # plan report, reason
    metrics = Signal(dict)
    apiStatus = Signal(dict)            # the `api` event: {"running": bool, "address": str | None, ...}
    died = Signal(str)                  # one line: what happened and what happens next

    def __init__(self, command: list[str] | None = None, log_path: Path | None = None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.command = command or default_worker_command()
        self.log_path = log_path
        self.state = "stopped"
        self.model: dict | None = None
        self.plan_report: dict | None = None
        self._proc: QProcess | None = None
        self._decoder = LineDecoder()
        self._queue: list[bytes] = []
        self._stopping = False
        self._deaths: collections.deque[float] = collections.deque(maxlen=MAX_RESTARTS + 1)
        self._last_load: dict | None = None
        self._budget: int | None = None
        self._running: str | None = None        # id of the generation in flight
        self._api_request: dict | None = None   # the api_start to repeat after a restart (None: API off)
        self.api: dict = {"running": False, "address": None}
        self._ids = itertools.count(1)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=40)

    # ---- process ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._proc is not None:
            return
        self._stopping = False
        self._decoder = LineDecoder()
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        if (_PROJECT_ROOT / "engine").is_dir():
            extra = env.value("PYTHONPATH", "")
            env.insert("PYTHONPATH", str(_PROJECT_ROOT) + (os.pathsep + extra if extra else ""))
        env.insert("PYTHONUNBUFFERED", "1")
        proc.setProcessEnvironment(env)
        proc.setWorkingDirectory(str(_PROJECT_ROOT))
        proc.readyReadStandardOutput.connect(self._read_stdout)
        proc.readyReadStandardError.connect(self._read_stderr)
        proc.finished.connect(self._finished)
        proc.errorOccurred.connect(self._process_error)
        self._proc = proc
        self._set_state("starting")
        proc.start(self.command[0], self.command[1:])

    def pid(self) -> int | None:
        if self._proc is None:
            return None
        pid = int(self._proc.processId())
        return pid or None

    def shutdown(self, wait_ms: int = 3000) -> None:
        """Ask the worker to exit; kill it if it has not within `wait_ms` (blocks at most that long)."""
        proc = self._proc
        self._stopping = True
        if proc is None:
            return
        if proc.state() == QProcess.ProcessState.Running:
            proc.write(encode_request("shutdown"))
            proc.closeWriteChannel()
            if not proc.waitForFinished(wait_ms):
                proc.kill()
                proc.waitForFinished(1000)
        self._proc = None
        self.api = {"running": False, "address": None}
        self._set_state("stopped")

    # ---- requests --------------------------------------------------------------------------------
    def load(self, source: str | None, device: str = "auto", backend: str = "auto") -> str:
        rid = f"load-{next(self._ids)}"
        self._last_load = {"source": source, "device": device, "backend": backend}
        self._send("load", id=rid, budget=self._budget, **self._last_load)
        if self.state in ("ready", "loaded"):
            self._set_state("loading")
        return rid

    def generate(self, messages: list[dict], params: dict | None = None, images: list[str] | None = None) -> str:
        rid = f"gen-{next(self._ids)}"
        self._running = rid
        self._send("generate", id=rid, messages=messages, params=params or {}, images=images or [])
        return rid

    def cancel(self, rid: str) -> None:
        self._send("cancel", id=rid)

    def set_budget(self, n_bytes: int | None) -> None:
        self._budget = n_bytes
        self._send("set_budget", bytes=n_bytes)

    def force_plan(self, kind: str) -> None:
        self._send("force_plan", kind=kind)

    def request_plan_report(self) -> None:
        self._send("plan_report")

    def api_start(self, port: int, key: str | None) -> None:
        """Serve the OpenAI-compatible API from the worker (the key travels over the worker's stdin)."""
        self._api_request = {"port": port, "key": key}
        self._send("api_start", id=f"api-{next(self._ids)}", **self._api_request)

    @property
    def api_wanted(self) -> bool:
        """An api_start was sent and no api_stop since (the worker runs the API, or will)."""
        return self._api_request is not None

    def api_stop(self) -> None:
        self._api_request = None
        self._send("api_stop", id=f"api-{next(self._ids)}")

    def unload(self) -> None:
        self._last_load = None
        self._send("unload")

    @property
    def generating(self) -> str | None:
        return self._running

    def _send(self, type_: str, **fields) -> None:
        data = encode_request(type_, **fields)
        proc = self._proc
        if self.state in ("starting", "restarting", "stopped", "failed") or proc is None:
            if type_ not in ("cancel",):
                self._queue.append(data)
            if proc is None and self.state not in ("failed",):
                self.start()
            return
        proc.write(data)

    # ---- events ----------------------------------------------------------------------------------
    def _read_stdout(self) -> None:
        if self._proc is None:
            return
        events, junk = self._decoder.feed(bytes(self._proc.readAllStandardOutput()))
        for line in junk:
            self._log(f"[stdout] {line}")
        for event in events:
            self._dispatch(event)

    def _read_stderr(self) -> None:
        if self._proc is None:
            return
        text = bytes(self._proc.readAllStandardError()).decode("utf-8", errors="replace")
        for line in text.splitlines():
            if line.strip():
                self.stderr_tail.append(line)
                self._log(line)

    def _dispatch(self, ev: dict) -> None:
        kind = ev["type"]
        if kind == "ready":
            if ev.get("protocol") != PROTOCOL_VERSION:
                self.error.emit(None, f"engine worker speaks protocol {ev.get('protocol')}, the app "
                                f"{PROTOCOL_VERSION}: reinstall Slipstream", "protocol")
            self._set_state("ready")
            self.ready.emit(ev)
            queued, self._queue = self._queue, []
            if not any(q.startswith(b'{"type":"load"') for q in queued) and self._last_load is not None:
                queued.insert(0, encode_request("load", id=f"load-{next(self._ids)}", budget=self._budget,
                                                **self._last_load))
                self._set_state("loading")
            if self._api_request is not None and not any(q.startswith(b'{"type":"api_') for q in queued):
                queued.append(encode_request("api_start", id=f"api-{next(self._ids)}", **self._api_request))
            for data in queued:
                if data.startswith(b'{"type":"load"'):
                    self._set_state("loading")
                self._proc.write(data)
        elif kind == "load_progress":
            self.loadProgress.emit(ev)
        elif kind == "loaded":
            self.model = ev.get("model") or {}
            self.plan_report = ev.get("plan_report")
            self._set_state("loaded")
            self.loaded.emit(ev)
        elif kind == "unloaded":
            self.model = None
            self.plan_report = None
            self._set_state("ready")
            self.unloaded.emit()
        elif kind == "token":
            self.token.emit(str(ev.get("id")), str(ev.get("text") or ""))
        elif kind == "done":
            if ev.get("id") == self._running:
                self._running = None
            self.done.emit(str(ev.get("id")), str(ev.get("finish_reason")), ev.get("stats") or {})
        elif kind == "error":
            if ev.get("kind") == "load":
                self._set_state("ready" if self.model is None else "loaded")
            self.error.emit(ev.get("id"), str(ev.get("message")), str(ev.get("kind") or ""))
        elif kind == "plan":
            self.plan_report = ev.get("report")
            self.plan.emit(ev.get("report") or {}, str(ev.get("reason") or ""))
        elif kind == "metrics":
            self.metrics.emit(ev)
        elif kind == "api":
            self.api = {k: v for k, v in ev.items() if k != "type"}
            self.apiStatus.emit(dict(self.api))

    def _finished(self, exit_code: int, exit_status) -> None:
        self._read_stdout()
        self._proc = None
        if self._stopping:
            self._set_state("stopped")
            return
        self._on_death(f"exit code {exit_code}" if exit_status == QProcess.ExitStatus.NormalExit
                       else "it crashed or was killed")

    def _process_error(self, err) -> None:
        if err == QProcess.ProcessError.FailedToStart:
            self._proc = None
            self._on_death(f"it could not be started ({' '.join(self.command)})")

    def _on_death(self, how: str) -> None:
        running, self._running = self._running, None
        self.model = None
        if self.api.get("running"):
            self.api = {"running": False, "address": None}
            self.apiStatus.emit(dict(self.api))
        now = time.monotonic()
        self._deaths.append(now)
        last = self.stderr_tail[-1] if self.stderr_tail else ""
        recent = [t for t in self._deaths if now - t < 60]
        if len(recent) > MAX_RESTARTS:
            self._set_state("failed")
            where = f" Its log: {self.log_path}." if self.log_path else ""
            self.died.emit(f"The engine stopped ({how}) {len(recent)} times in a minute; not restarting.{where} "
                           f"{last}".strip())
        else:
            what = " and reloading the model" if self._last_load is not None else ""
            self._set_state("restarting")
            self.died.emit(f"The engine stopped unexpectedly ({how}); restarting it{what}.")
            QTimer.singleShot(RESTART_DELAY_MS, self, self.start)
        if running is not None:
            self.done.emit(running, "interrupted", {})

    def restart(self) -> None:
        """Start again after `failed` (the user asked)."""
        self._deaths.clear()
        if self._proc is None:
            self.start()

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.stateChanged.emit(state)

    def _log(self, line: str) -> None:
        if self.log_path is None:
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
        except OSError:
            pass
