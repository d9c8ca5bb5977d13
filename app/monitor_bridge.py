"""`MonitorBridge`: the VRAM monitor (`monitor.Monitor`, its own thread) seen through Qt signals.

`snapshot` fires at the chart rate with the monitor's latest sample; `budgetEvent` fires when the
monitor's budget policy moves the budget (emitted from the monitor's thread, delivered queued on the UI
thread). Where the monitor cannot start, `status` says why and the signals stay quiet.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, QTimer, Signal


class MonitorBridge(QObject):
    snapshot = Signal(object)
    budgetEvent = Signal(object)

    def __init__(self, reserve: int = 1 << 30, interval_s: float = 0.25, parent: QObject | None = None):
        super().__init__(parent)
        self.reserve = reserve
        self.interval_s = interval_s
        self.status = "not started"
        self._monitor = None
        self._own_pids: list[int] = []
        self._timer = QTimer(self)
        self._timer.setInterval(int(interval_s * 1000))
        self._timer.timeout.connect(self._poll)

    def start(self) -> None:
        try:
            from monitor import BudgetPolicy, Monitor

            self._monitor = Monitor(interval_s=self.interval_s,
                                    policy=BudgetPolicy(mode="auto", user_cap=None, reserve=self.reserve))
            self._monitor.subscribe(self._on_event)
            if self._own_pids:
                self._monitor.set_own_pids(self._own_pids)
            self._monitor.start()
            self.status = "running"
        except Exception as exc:  # noqa: BLE001 - the app runs without charts of other processes
            self._monitor = None
            self.status = f"monitor unavailable: {type(exc).__name__}: {exc}"
            return
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()
        if self._monitor is not None:
            try:
                self._monitor.stop()
            except Exception as exc:  # noqa: BLE001 - stopping must not fail the app's exit
                self.status = f"monitor stop failed: {exc}"
            self._monitor = None

    def set_own_pids(self, pids: list[int]) -> None:
        self._own_pids = [p for p in pids if p]
        if self._monitor is not None:
            try:
                self._monitor.set_own_pids(self._own_pids)
            except Exception as exc:  # noqa: BLE001 - the charts then count the worker as "others"
                self.status = f"monitor: set_own_pids failed: {exc}"

    def set_own_vram(self, n_bytes: int | None) -> None:
        """The engine's own VRAM figure, for drivers that do not attribute memory to our process."""
        if self._monitor is not None:
            self._monitor.set_own_vram(n_bytes)

    def set_reserve(self, n_bytes: int) -> None:
        self.reserve = n_bytes
        if self._monitor is not None:
            self._monitor.policy.set_reserve(n_bytes)

    def latest(self):
        if self._monitor is None:
            return None
        try:
            return self._monitor.latest()
        except Exception:  # noqa: BLE001
            return None

    def _poll(self) -> None:
        snap = self.latest()
        if snap is not None:
            status = getattr(snap, "status", "")
            if status:
                self.status = str(status)
            self.snapshot.emit(snap)

    def _on_event(self, event) -> None:
        # Called on the monitor's thread: the signal is delivered queued on the UI thread.
        if hasattr(event, "budget") and hasattr(event, "reason"):
            self.budgetEvent.emit(event)
