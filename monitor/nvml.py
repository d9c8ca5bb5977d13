"""The NVML session: loading the library, init/shutdown, and the one wrapper every NVML call goes through.

`Nvml.call("nvmlDeviceGetMemoryInfo", handle)` returns the value or a `NotAvailable` carrying the reason
("Not Supported", "GPU is lost", ...). Nothing here raises: the monitor turns a missing library, a
missing driver or a failing call into a status the user can read, and the app runs CPU-only.
"""

from __future__ import annotations

import threading
import time
from types import ModuleType
from typing import Any

# Errors after which the device is gone until NVML is opened again (names of pynvml's error classes).
_FATAL = frozenset({
    "NVMLError_Uninitialized", "NVMLError_DriverNotLoaded", "NVMLError_LibraryNotFound",
    "NVMLError_GpuIsLost", "NVMLError_ResetRequired", "NVMLError_LibRmVersionMismatch",
    "NVMLError_FunctionNotFound",
})


class NotAvailable:
    """A value that stands for "NVML could not tell": falsy, with the reason and whether it is fatal."""

    __slots__ = ("fatal", "reason")

    def __init__(self, reason: str, fatal: bool = False) -> None:
        self.reason = reason
        self.fatal = fatal

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"NotAvailable({self.reason!r})"


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    if type(exc).__name__.startswith("NVMLError"):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Nvml:
    """One NVML library (the real `pynvml` or a fake with the same names), opened lazily, retried slowly.

    `open()` returns "" when NVML is ready, else the reason it is not; after a failure it tries again at
    most every `retry_s` seconds (a driver installed or restarted while the app runs is picked up).
    """

    def __init__(self, lib: ModuleType | Any | None = None, retry_s: float = 10.0) -> None:
        self._lib = lib
        self._retry_s = retry_s
        self._ready = False
        self._reason = "not opened"
        self._last_try = -float("inf")
        self._lock = threading.Lock()
        self.handles: list[Any] = []
        self.names: list[str] = []

    @property
    def ready(self) -> bool:
        return self._ready

    @property
    def reason(self) -> str:
        return "" if self._ready else self._reason

    def open(self) -> str:
        with self._lock:
            if self._ready:
                return ""
            now = time.monotonic()
            if now - self._last_try < self._retry_s:
                return self._reason
            self._last_try = now
            self._reason = self._open()
            self._ready = not self._reason
            return self._reason

    def _open(self) -> str:
        if self._lib is None:
            try:
                import pynvml  # nvidia-ml-py
            except ImportError:
                return "nvidia-ml-py is not installed"
            self._lib = pynvml
        init = self.call("nvmlInit")
        if isinstance(init, NotAvailable):
            return f"NVML did not start ({init.reason})"
        count = self.call("nvmlDeviceGetCount")
        if isinstance(count, NotAvailable):
            return f"NVML could not count GPUs ({count.reason})"
        if count == 0:
            return "the driver reports no GPU"
        handles = [self.call("nvmlDeviceGetHandleByIndex", i) for i in range(count)]
        bad = [h for h in handles if isinstance(h, NotAvailable)]
        if bad:
            return f"NVML could not open a GPU ({bad[0].reason})"
        self.handles = handles
        self.names = [_text(self.call("nvmlDeviceGetName", h), f"GPU {i}") for i, h in enumerate(handles)]
        return ""

    def close(self, reason: str = "closed") -> None:
        """Forget the devices (after a fatal error); the next `open()` starts NVML again."""
        with self._lock:
            if self._ready:
                self.call("nvmlShutdown")
            self._ready = False
            self._reason = reason
            self.handles, self.names = [], []

    def call(self, fn: str, *args: Any) -> Any:
        """The wrapper: `lib.<fn>(*args)`, or NotAvailable(reason) for any error, never an exception."""
        try:
            return getattr(self._lib, fn)(*args)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a value by design
            return NotAvailable(_reason(exc), fatal=type(exc).__name__ in _FATAL)


def _text(value: Any, default: str) -> str:
    if isinstance(value, NotAvailable):
        return default
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
