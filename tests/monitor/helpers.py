"""Replaying the recorded traces under tests/monitor/traces through a Monitor with the fake NVML."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from monitor import BudgetEvent, BudgetPolicy, Monitor, Snapshot
from monitor.fake_nvml import FakeNvml

TRACES = Path(__file__).parent / "traces"
WORKER_PID = 5000   # Slipstream's worker in every trace
GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Replay:
    fake: FakeNvml
    monitor: Monitor
    snaps: list[Snapshot] = field(default_factory=list)
    events: list[BudgetEvent] = field(default_factory=list)

    def index_at(self, t: float) -> int:
        """The first sample at or after time t."""
        return next(i for i, s in enumerate(self.snaps) if s.time >= t - 1e-9)

    def first(self, pred: Callable[[Snapshot], bool]) -> int:
        return next(i for i, s in enumerate(self.snaps) if pred(s))


def run_trace(name: str, policy: BudgetPolicy | None = None,
              before_sample: Callable[[int, Monitor], None] | None = None, **monitor_kw) -> Replay:
    """Sample every frame of `traces/<name>.json`; `before_sample(i, monitor)` may change settings."""
    fake = FakeNvml(TRACES / f"{name}.json")
    mon = fake.monitor(policy=policy or BudgetPolicy(), **monitor_kw)
    mon.set_own_pids({WORKER_PID})
    rep = Replay(fake, mon)
    mon.subscribe(rep.events.append)
    while True:
        if before_sample is not None:
            before_sample(len(rep.snaps), mon)
        rep.snaps.append(mon.sample_once())
        if not fake.advance():
            return rep


def room(snap: Snapshot, reserve: int = GiB) -> int:
    """The formula's room: total - others - reserve, never below 0."""
    return max(0, snap.gpu.total - snap.others_vram - reserve)


def vram_of(snap: Snapshot, pid: int) -> int | None:
    return next((p.vram_bytes for p in snap.processes if p.pid == pid), None)
