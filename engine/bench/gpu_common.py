"""Shared pieces of the GPU benchmarks: random-weight engines of named shapes, NVML polling, reports."""

from __future__ import annotations

import json
import os
import platform
import threading
import time
from datetime import datetime, timezone
from pathlib import Path


def open_shape(shape: str, budget, device: str = "cuda", seed: int = 0, n_ctx: int | None = None,
               layers: int = 0):
    """A TorchEngine over random weights of a named shape (or a dry-run one, `tiny-moe`, `tiny-llama`; weights
    do not change speed); `layers`: keep only the first that many layers (0: all). The generation's buffers
    go back to the driver."""
    import dataclasses

    import torch

    from engine.backends.torch_engine import TorchEngine
    from engine.bench.scenarios import DRY_CONFIGS
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = DRY_CONFIGS[shape]() if shape in DRY_CONFIGS else get_shape(shape)
    if layers:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    loaded = random_model(cfg, seed=seed, name=shape)
    eng = TorchEngine(loaded, device=device, vram_budget=budget, n_ctx=n_ctx, speculative=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return eng


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


def _cpu_ticks() -> tuple[int, int] | None:
    """(all, steal) jiffies of the host's CPUs from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]), (fields[7] if len(fields) > 7 else 0)


def lease_probe(weight_mib: int = 1024, min_s: float = 1.0, copy_mib: int = 256) -> dict:
    """How fast this machine is right now, in about two seconds: one-token bf16 matmuls over `weight_mib`
    of weights through the engine's CPU path (more than the caches hold), the share of CPU time the
    hypervisor stole meanwhile, and (with a GPU) pinned host -> GPU copies. Lent machines differ from
    lease to lease (up to 1.9x for the same plan, docs/benchmarks/README.md, session 5); each part records
    this beside its rows."""
    import torch

    from engine.models.dense import linear

    rows = 4096
    n = max(1, weight_mib * (1 << 20) // (2 * rows * 4096))
    ws = [torch.full((rows, 4096), 0.01, dtype=torch.bfloat16) for _ in range(n)]   # values do not matter
    x = torch.full((1, 4096), 0.5, dtype=torch.bfloat16)
    for w in ws[:2]:
        linear(x, w)
    before, t0, done = _cpu_ticks(), time.perf_counter(), 0
    while True:
        for w in ws:
            linear(x, w)
        done += 1
        if time.perf_counter() - t0 >= min_s:
            break
    sec = time.perf_counter() - t0
    after = _cpu_ticks()
    out = {"cpu_gemv_gbps": round(done * n * 2 * rows * 4096 / sec / 1e9, 2), "cpu_threads": torch.get_num_threads(),
           "steal_share": (round((after[1] - before[1]) / max(after[0] - before[0], 1), 4)
                           if before and after else None),
           "loadavg": [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None,
           "h2d_gbps": None}
    if torch.cuda.is_available():
        out["h2d_gbps"] = round(h2d_gbps(torch.empty(copy_mib << 20, dtype=torch.uint8, pin_memory=True), 8), 2)
    return out


def rates_probe(weight_mib: int = 1024, copy_mib: int = 256, min_s: float = 0.3) -> dict:
    """The four rates the bound (`engine.bench.bound`) is computed from, measured now and the way the profile
    measures them (`measure_link.link_section`): the CPU's one-token GEMV over `weight_mib` of FFN-shaped
    weights (pinned beside a GPU, as the executor keeps them) alone and while back-to-back pinned
    host -> GPU copies of `copy_mib` run, and those copies alone and beside it; the share of CPU time the
    hypervisor stole meanwhile. Without a GPU the copy rates are None. A suite row records it before its
    engine opens and after it closes (about three seconds each), so its ratio to the bound can also be taken
    against the machine as it was then: leases of the same kind have differed by 1.5x in these rates."""
    import torch

    from engine.sharding.measure_link import probe_rates

    before = _cpu_ticks()
    out = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           **probe_rates(weight_mib, copy_mib, min_s)}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    after = _cpu_ticks()
    out["steal_share"] = (round((after[1] - before[1]) / max(after[0] - before[0], 1), 4)
                          if before and after else None)
    return out


def h2d_gbps(src, reps: int = 10, dst=None) -> float:
    """Host -> GPU copy rate of `src` (into `dst`, default a new GPU tensor): `reps` copies after one."""
    import torch

    dst = torch.empty_like(src, device="cuda") if dst is None else dst
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return src.numel() * src.element_size() * reps / (time.perf_counter() - t) / 1e9


def write_report(out: Path, name: str, payload: dict, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), **payload}
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path
