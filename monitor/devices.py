"""One round of NVML reads: every GPU's memory, utilisation and PCIe link, and every process on it.

A process is taken from both the compute and the graphics lists (a game shows up in the graphics list)
and merged by pid. Reads that fail become notes, not exceptions; a fatal error ends the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from monitor.nvml import NotAvailable, Nvml
from monitor.snapshot import GpuSample

_LISTS = (("compute", "nvmlDeviceGetComputeRunningProcesses"),
          ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"))


@dataclass(slots=True)
class RawProcess:
    """A pid on one GPU as NVML lists it, before psutil and game detection."""
    pid: int
    gpu_index: int
    kinds: set[str]
    vram: int | None


@dataclass(slots=True)
class DeviceRead:
    gpus: list[GpuSample] = field(default_factory=list)
    processes: list[RawProcess] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failed: dict[int, NotAvailable] = field(default_factory=dict)   # gpu index -> why memory is unknown
    fatal: NotAvailable | None = None


def read_devices(nvml: Nvml) -> DeviceRead:
    out = DeviceRead()
    for index, handle in enumerate(nvml.handles):
        mem = nvml.call("nvmlDeviceGetMemoryInfo", handle)
        if isinstance(mem, NotAvailable):
            if mem.fatal:
                out.fatal = mem
                return out
            out.failed[index] = mem
            continue
        util = nvml.call("nvmlDeviceGetUtilizationRates", handle)
        gen = nvml.call("nvmlDeviceGetCurrPcieLinkGeneration", handle)
        width = nvml.call("nvmlDeviceGetCurrPcieLinkWidth", handle)
        out.gpus.append(GpuSample(
            index=index, name=nvml.names[index], total=int(mem.total), used=int(mem.used),
            free=int(mem.free), utilization=_int_or_none(getattr(util, "gpu", util)),
            pcie_gen=_int_or_none(gen), pcie_width=_int_or_none(width)))
        merged: dict[int, RawProcess] = {}
        for kind, fn in _LISTS:
            procs = nvml.call(fn, handle)
            if isinstance(procs, NotAvailable):
                if procs.fatal:
                    out.fatal = procs
                    return out
                out.notes.append(f"GPU {index} {kind} process list: {procs.reason}")
                continue
            for p in procs:
                _merge(merged, int(p.pid), index, kind, getattr(p, "usedGpuMemory", None))
        out.processes.extend(merged.values())
    return out


def _merge(merged: dict[int, RawProcess], pid: int, index: int, kind: str, used: int | None) -> None:
    vram = int(used) if used is not None else None
    seen = merged.get(pid)
    if seen is None:
        merged[pid] = RawProcess(pid, index, {kind}, vram)
        return
    # A process in both lists is reported with its whole footprint in each: take the larger, never the sum.
    seen.kinds.add(kind)
    if vram is not None:
        seen.vram = vram if seen.vram is None else max(seen.vram, vram)


def _int_or_none(value: object) -> int | None:
    if isinstance(value, NotAvailable) or value is None:
        return None
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
