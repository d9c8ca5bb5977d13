"""The trace format: what NVML reported over time, as JSON the fake NVML replays and the recorder writes.

    {"name": str, "description": str, "interval_s": 0.1,
     "devices": [{"name": str, "total": "24GiB", "pcie_gen": 4, "pcie_width": 16, "baseline": "600MiB"}],
     "process_table": {"4242": {"name": "game.exe", "exe": "C:/.../game.exe"}},
     "init_error": null,                        # e.g. "DriverNotLoaded": nvmlInit fails
     "frames": [{"dt": 0.1, "repeat": 10,       # or "t": absolute seconds
                 "gpus": [{"compute": {"5000": "2GiB"}, "graphics": {"4242": "9.8GiB", "77": null},
                           "used": "12GiB", "util": 97}],      # used defaults to baseline + processes
                 "errors": {"nvmlDeviceGetGraphicsRunningProcesses": "NotSupported"}}]}

Sizes are bytes or strings such as "9.8GiB"; a process size of null is "not available" (WDDM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from monitor.snapshot import Snapshot
from monitor.units import parse_size


@dataclass(frozen=True, slots=True)
class GpuFrame:
    used: int
    util: int | None
    compute: dict[int, int | None]
    graphics: dict[int, int | None]


@dataclass(frozen=True, slots=True)
class Frame:
    t: float
    gpus: tuple[GpuFrame, ...]
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    total: int
    pcie_gen: int | None = None
    pcie_width: int | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    devices: tuple[Device, ...]
    frames: tuple[Frame, ...]
    process_table: dict[int, tuple[str, str | None]]
    init_error: str | None = None
    description: str = ""


def load_trace(source: str | Path | dict) -> Trace:
    """A path to a trace JSON, or the parsed dict. Raises ValueError naming the file and field."""
    where = str(source) if not isinstance(source, dict) else "trace"
    data = source if isinstance(source, dict) else json.loads(Path(source).read_text(encoding="utf-8"))
    try:
        return _parse(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: not a valid monitor trace ({exc})") from exc


def _parse(data: dict) -> Trace:
    interval = float(data.get("interval_s", 0.1))
    devices = tuple(Device(d["name"], parse_size(d["total"]), d.get("pcie_gen"), d.get("pcie_width"))
                    for d in data.get("devices", []))
    baselines = [parse_size(d.get("baseline", 0)) for d in data.get("devices", [])]
    frames: list[Frame] = []
    t = 0.0
    for i, f in enumerate(data.get("frames", [])):
        gpus = tuple(_gpu_frame(g, baselines[j]) for j, g in enumerate(f.get("gpus", [])))
        if len(gpus) != len(devices):
            raise ValueError(f"frame {i}: {len(gpus)} gpus for {len(devices)} devices")
        errors = dict(f.get("errors", {}))
        for k in range(int(f.get("repeat", 1))):
            if k == 0 and "t" in f:
                t = float(f["t"])
            elif frames:
                t += float(f.get("dt", interval))
            frames.append(Frame(t, gpus, errors))
    table = {int(pid): (str(v.get("name", "")), v.get("exe")) for pid, v in data.get("process_table", {}).items()}
    return Trace(str(data.get("name", "trace")), devices, tuple(frames), table, data.get("init_error"),
                 str(data.get("description", "")))


def _gpu_frame(g: dict, baseline: int) -> GpuFrame:
    compute = {int(pid): _size(v) for pid, v in g.get("compute", {}).items()}
    graphics = {int(pid): _size(v) for pid, v in g.get("graphics", {}).items()}
    if "used" in g:
        used = parse_size(g["used"])
    else:   # a process in both lists counts once
        per_pid = {**{p: v or 0 for p, v in graphics.items()}, **{p: v or 0 for p, v in compute.items()}}
        used = baseline + sum(per_pid.values())
    return GpuFrame(used, g.get("util"), compute, graphics)


def _size(v: object) -> int | None:
    return None if v is None else parse_size(v)  # type: ignore[arg-type]


def trace_from_snapshots(snaps: list[Snapshot], name: str, description: str = "") -> dict:
    """Record what a Monitor saw as a trace dict (json.dump it); the fake NVML replays it."""
    good = [s for s in snaps if s.gpus]
    if not good:
        return {"name": name, "description": description, "init_error": "NotFound", "frames": []}
    first = good[0]
    devices = [{"name": g.name, "total": g.total, "pcie_gen": g.pcie_gen, "pcie_width": g.pcie_width}
               for g in first.gpus]
    table: dict[str, dict] = {}
    frames = []
    for s in good:
        gpus = []
        for g in s.gpus:
            mine = [p for p in s.processes if p.gpu_index == g.index]
            gpus.append({"used": g.used, "util": g.utilization,
                         "compute": {str(p.pid): p.vram_bytes for p in mine if "compute" in p.kinds},
                         "graphics": {str(p.pid): p.vram_bytes for p in mine if "graphics" in p.kinds}})
            for p in mine:
                table[str(p.pid)] = {"name": p.name, "exe": p.exe}
        if len(gpus) == len(devices):
            frames.append({"t": round(s.time - first.time, 4), "gpus": gpus})
    return {"name": name, "description": description, "devices": devices,
            "process_table": table, "frames": frames}
