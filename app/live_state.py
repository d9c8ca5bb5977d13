"""`LiveState`: the latest values the charts and status labels draw from, updated by the controller as
monitor snapshots and worker events arrive, read at the chart tick."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

METRICS_STALE_S = 2.0


@dataclass(slots=True)
class LiveState:
    snapshot: object | None = None          # monitor.Snapshot
    monitor_status: str = ""
    metrics: dict = field(default_factory=dict)
    metrics_time: float = 0.0
    budget: int | None = None               # the budget last sent to the engine
    plan_report: dict | None = None
    generating: bool = False

    def fresh_metrics(self) -> dict:
        return self.metrics if time.monotonic() - self.metrics_time < METRICS_STALE_S else {}

    def set_metrics(self, metrics: dict) -> None:
        self.metrics = metrics
        self.metrics_time = time.monotonic()

    def vram_sample(self) -> tuple[float | None, float | None, float | None, float | None, str]:
        """(own, games, others, total, note) in bytes, from the monitor where it sees a GPU, else from
        the engine's own report."""
        snap = self.snapshot
        gpus = list(getattr(snap, "gpus", None) or [])
        if gpus:
            total = float(sum(getattr(g, "total", 0) or 0 for g in gpus))
            procs = list(getattr(snap, "processes", None) or [])
            games = float(sum((p.vram_bytes or 0) for p in procs if getattr(p, "is_game", False)
                              and not getattr(p, "is_own", False)))
            own = float(getattr(snap, "own_vram", 0) or 0)
            others = float(getattr(snap, "others_vram", 0) or 0)
            if getattr(snap, "others_vram", None) is None:
                used = float(sum(getattr(g, "used", 0) or 0 for g in gpus))
                others = max(0.0, used - own)
            return own, games, max(0.0, others - games), total, ""
        status = str(getattr(snap, "status", "") or self.monitor_status or "no GPU monitor")
        own = self.fresh_metrics().get("own_vram") if self.metrics else None
        return own, None, None, None, f"{status.split(':')[0]}: showing Slipstream's planned VRAM"
