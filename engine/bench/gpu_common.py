"""Shared pieces of the GPU benchmarks: random-weight engines of named shapes, NVML polling, reports."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from datetime import datetime, timezone
from pathlib import Path


def open_shape(shape: str, budget, device: str = "cuda", seed: int = 0, n_ctx: int | None = None):
    """A TorchEngine over random weights of a named shape (weights do not change speed)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    loaded = random_model(get_shape(shape), seed=seed, name=shape)
    return TorchEngine(loaded, device=device, vram_budget=budget, n_ctx=n_ctx, speculative=False)


class NvmlPoller:
    """Samples this process's VRAM (and the device's) every `interval_s` on a thread."""

    def __init__(self, interval_s: float = 0.005, index: int = 0):
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval = interval_s
        self.samples: list[tuple[float, int, int]] = []   # (perf_counter, own bytes, device used)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def own_bytes(self) -> int:
        pid = os.getpid()
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return -1
        return sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)

    def sample(self) -> tuple[float, int, int]:
        used = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
        return time.perf_counter(), self.own_bytes(), used

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def peak_own(self) -> int:
        return max((s[1] for s in self.samples), default=0)


def machine_info() -> dict:
    import torch

    info = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpu_threads": os.cpu_count(), "torch": torch.__version__}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def write_report(out: Path, name: str, payload: dict, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), **payload}
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
