"""A fake `pynvml` that replays a trace (see `monitor.trace`), errors included, for tests and demos.

`FakeNvml(trace)` has the names the monitor calls (`nvmlInit`, `nvmlDeviceGetMemoryInfo`,
`nvmlDeviceGetComputeRunningProcesses`, ...) and pynvml's error classes (`NVMLError_NotSupported`, ...).
It stays on one frame until `advance()`; `now()` is the frame's time, to pass to `Monitor(clock=...)`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from monitor.known_apps import KnownApps
from monitor.processes import Identity, TableLookup
from monitor.trace import Trace, load_trace

# pynvml's class-name suffix -> the text str(error) gives, as the real library words it.
_ERRORS = {
    "Uninitialized": "Uninitialized", "InvalidArgument": "Invalid Argument", "NotSupported": "Not Supported",
    "NoPermission": "Insufficient Permissions", "AlreadyInitialized": "Already Initialized",
    "NotFound": "Not Found", "InsufficientSize": "Insufficient Size", "DriverNotLoaded": "Driver Not Loaded",
    "Timeout": "Timeout", "LibraryNotFound": "NVML Shared Library Not Found",
    "FunctionNotFound": "Function Not Found", "GpuIsLost": "GPU is lost", "ResetRequired": "GPU requires restart",
    "Unknown": "Unknown Error",
}


class NVMLError(Exception):
    """Like pynvml.NVMLError: str() is NVML's message; subclasses are named NVMLError_<Name>."""
    message = "Unknown Error"

    def __str__(self) -> str:
        return self.message


ERROR_CLASSES: dict[str, type[NVMLError]] = {
    name: type(f"NVMLError_{name}", (NVMLError,), {"message": text}) for name, text in _ERRORS.items()
}


def error(name: str) -> NVMLError:
    """An instance of the fake error class named by its suffix, e.g. error("NotSupported")."""
    if name not in ERROR_CLASSES:
        raise ValueError(f"NVML error {name!r}: expected one of {', '.join(ERROR_CLASSES)}")
    return ERROR_CLASSES[name]()


class FakeNvml:
    def __init__(self, trace: Trace | str | Path | dict) -> None:
        self.trace = trace if isinstance(trace, Trace) else load_trace(trace)
        self.index = 0
        self.initialized = False
        self.calls = 0
        for name, cls in ERROR_CLASSES.items():
            setattr(self, f"NVMLError_{name}", cls)
        self.NVMLError = NVMLError
        self.processes = TableLookup({pid: Identity(n, e) for pid, (n, e) in self.trace.process_table.items()})

    # --- replay control ----------------------------------------------------------------------------
    @property
    def frame(self):
        return self.trace.frames[self.index]

    def now(self) -> float:
        return self.frame.t if self.trace.frames else 0.0

    def advance(self) -> bool:
        """Move to the next frame; False (and stay) at the end."""
        if self.index + 1 >= len(self.trace.frames):
            return False
        self.index += 1
        return True

    def monitor(self, **kwargs: Any):
        """A Monitor wired to this fake: its NVML, its process table, its clock, the shipped app list."""
        from monitor.sampling import Monitor
        kwargs.setdefault("processes", self.processes)
        kwargs.setdefault("known_apps", KnownApps.load(False))
        kwargs.setdefault("clock", self.now)
        return Monitor(nvml=kwargs.pop("nvml", self), **kwargs)

    def replay(self, monitor) -> list:
        """Sample every frame from the current one to the end; returns the snapshots."""
        snaps = [monitor.sample_once()]
        while self.advance():
            snaps.append(monitor.sample_once())
        return snaps

    # --- the pynvml surface --------------------------------------------------------------------------
    def _check(self, fn: str) -> None:
        self.calls += 1
        if not self.initialized and fn != "nvmlInit":
            raise error("Uninitialized")
        if self.trace.frames and fn in self.frame.errors:
            raise error(self.frame.errors[fn])

    def nvmlInit(self) -> None:
        if self.trace.init_error:
            self.calls += 1
            raise error(self.trace.init_error)
        self._check("nvmlInit")
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.trace.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.trace.devices):
            raise error("InvalidArgument")
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        self._check("nvmlDeviceGetName")
        return self.trace.devices[h].name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetMemoryInfo")
        total, used = self.trace.devices[h].total, self.frame.gpus[h].used
        return SimpleNamespace(total=total, used=used, free=max(0, total - used))

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        self._check("nvmlDeviceGetUtilizationRates")
        util = self.frame.gpus[h].util
        if util is None:
            raise error("NotSupported")
        return SimpleNamespace(gpu=util, memory=0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkGeneration")
        return _or_not_supported(self.trace.devices[h].pcie_gen)

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        self._check("nvmlDeviceGetCurrPcieLinkWidth")
        return _or_not_supported(self.trace.devices[h].pcie_width)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetComputeRunningProcesses")
        return _procs(self.frame.gpus[h].compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[SimpleNamespace]:
        self._check("nvmlDeviceGetGraphicsRunningProcesses")
        return _procs(self.frame.gpus[h].graphics)

    def nvmlSystemGetProcessName(self, pid: int) -> str:
        self._check("nvmlSystemGetProcessName")
        if pid not in self.trace.process_table:
            raise error("NotFound")
        return self.trace.process_table[pid][0]

    def nvmlSystemGetDriverVersion(self) -> str:
        self._check("nvmlSystemGetDriverVersion")
        return "fake"


def _procs(table: dict[int, int | None]) -> list[SimpleNamespace]:
    return [SimpleNamespace(pid=pid, usedGpuMemory=v, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            for pid, v in table.items()]


def _or_not_supported(value: int | None) -> int:
    if value is None:
        raise error("NotSupported")
    return value
