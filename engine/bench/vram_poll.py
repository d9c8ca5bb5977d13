"""Per-process VRAM over time through NVML, for any process (a llama-bench child, the game stand-in).

`VramPoller(pids)` samples every `interval_s` on a thread: the device's used bytes and each watched
process's bytes (NVML's compute and graphics process lists). `pids` may be a callable, for a child that
starts later; `nvml` may be a stand-in with pynvml's names (`simcard.SimCard` in dry runs). Where NVML is missing (a CPU-only dry run) `VramPoller.available` is False and every
figure reads 0, so the harness logic still runs. `bare_context_bytes` measures what a process costs
on the GPU before it holds any data (its CUDA context), the allowance beside a VRAM budget.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from typing_extensions import Self


def _nvml():
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlDeviceGetHandleByIndex(0)
        return pynvml
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: a dry run
        return None


class VramPoller:
    def __init__(self, pids: Iterable[int] | Callable[[], Iterable[int]] = (), interval_s: float = 0.05,
                 index: int = 0, nvml=None):
        self.nvml = nvml if nvml is not None else _nvml()
        self.available = self.nvml is not None
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index) if self.nvml else None
        self._pids = pids if callable(pids) else (lambda p=tuple(pids): p)
        self.interval = interval_s
        self.samples: list[tuple[float, int, dict[int, int]]] = []   # (perf_counter, device used, {pid: bytes})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def per_process(self) -> dict[int, int]:
        if not self.nvml:
            return {}
        out: dict[int, int] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                for p in getattr(self.nvml, fn)(self.handle):
                    out[p.pid] = max(out.get(p.pid, 0), int(p.usedGpuMemory or 0))
            except Exception:  # noqa: BLE001, S112 - one list missing (NotSupported) leaves the other
                continue
        return out

    def device_used(self) -> int:
        if not self.nvml:
            return 0
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def device_total(self) -> int:
        if not self.nvml:
            return 0
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).total)

    def sample(self) -> tuple[float, int, dict[int, int]]:
        procs = self.per_process()
        watched = set(self._pids())
        return time.perf_counter(), self.device_used(), {p: b for p, b in procs.items() if p in watched}

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def peak(self, pid: int | None = None) -> int:
        """Peak bytes of `pid` (None: the sum of the watched processes) over the samples."""
        if pid is None:
            return max((sum(s[2].values()) for s in self.samples), default=0)
        return max((s[2].get(pid, 0) for s in self.samples), default=0)

    def timeline(self, t0: float, every: int = 1) -> list[list]:
        """[[seconds since t0, device used, {pid: bytes}], ...] for raw logs."""
        return [[round(t - t0, 3), used, {str(k): v for k, v in procs.items()}]
                for t, used, procs in self.samples[::every]]


_BARE_TORCH = ("import torch, time, sys; a = torch.ones(1024, 1024, device='cuda', dtype=torch.bfloat16); "
               "(a @ a).sum().item(); torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()")


def bare_context_bytes(argv: list[str] | None = None, settle_s: float = 1.0, timeout_s: float = 60.0) -> int:
    """NVML bytes of a process that has set up CUDA and run one small matmul, then waits (default: a
    bare PyTorch process). 0 where NVML is missing."""
    poll = VramPoller()
    if not poll.available:
        return 0
    proc = subprocess.Popen(argv or [sys.executable, "-c", _BARE_TORCH], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        line = proc.stdout.readline()
        if "ready" not in line:
            return 0
        time.sleep(settle_s)
        peak = 0
        while time.monotonic() < deadline:
            now = poll.per_process().get(proc.pid, 0)
            if now and now == peak:
                break
            peak = max(peak, now)
            time.sleep(0.2)
        return peak
    finally:
        proc.kill()
        proc.wait()
