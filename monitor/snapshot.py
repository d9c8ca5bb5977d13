"""What one sample saw, as frozen values the UI can keep: `GpuSample`, `ProcessSample`, `Snapshot`.

Sizes are bytes. `None` means "not available" (the driver does not report it), never a guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

NO_GPU = "no NVIDIA GPU"  # the prefix of `Snapshot.status` when the app must run CPU-only


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    name: str
    total: int
    used: int
    free: int
    utilization: int | None = None   # percent of time a kernel ran over the last sample period
    pcie_gen: int | None = None
    pcie_width: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessSample:
    pid: int
    name: str                        # "" when the process could not be looked up
    exe: str | None                  # full path of the executable; None when not available
    vram_bytes: int | None           # None where the driver does not report it (Windows WDDM, MIG)
    gpu_index: int
    kinds: frozenset[str]            # {"compute"} / {"graphics"} / both
    is_game: bool = False
    is_own: bool = False
    reason: str = ""                 # why it counts as a game or heavy app, or ""

    @property
    def label(self) -> str:
        return self.name or f"pid {self.pid}"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kinds"] = sorted(self.kinds)
        return d


@dataclass(frozen=True, slots=True)
class Snapshot:
    time: float                      # time.monotonic() (or the injected clock) when sampled
    wall_time: float                 # time.time()
    status: str                      # "ok", "no NVIDIA GPU: <reason>" or "NVML error: <reason>"
    gpus: tuple[GpuSample, ...] = ()
    processes: tuple[ProcessSample, ...] = ()
    budget: int | None = None        # bytes Slipstream may use on `gpu_index`; None = no GPU
    gaming: bool = False
    own_vram: int = 0                # Slipstream's processes on `gpu_index`
    others_vram: int = 0             # device used minus our own share
    gpu_index: int = 0
    mode: str = "auto"
    paused: bool = False
    notes: tuple[str, ...] = field(default=())   # e.g. "graphics process list: Not Supported"

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def gpu(self) -> GpuSample | None:
        """The GPU the budget is for, or None."""
        for g in self.gpus:
            if g.index == self.gpu_index:
                return g
        return None

    def games(self) -> tuple[ProcessSample, ...]:
        return tuple(p for p in self.processes if p.is_game)

    def as_dict(self) -> dict:
        """JSON-able: {"status", "gpus", "processes", "budget", ...}."""
        return {
            "status": self.status,
            "time": self.time,
            "wall_time": self.wall_time,
            "gpu_index": self.gpu_index,
            "gpus": [asdict(g) for g in self.gpus],
            "processes": [p.as_dict() for p in self.processes],
            "budget": self.budget,
            "mode": self.mode,
            "paused": self.paused,
            "gaming": self.gaming,
            "own_vram": self.own_vram,
            "others_vram": self.others_vram,
            "notes": list(self.notes),
        }
