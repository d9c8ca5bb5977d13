"""Slipstream's VRAM monitor: live per-process VRAM through NVML, game detection, and the budget policy.

Imports neither torch nor Qt, starts before the engine and costs almost nothing (a sample every 0.1 s).

    from monitor import Monitor, BudgetPolicy
    m = Monitor(interval_s=0.1, policy=BudgetPolicy(mode="auto"))
    m.subscribe(lambda ev: print(ev.budget, ev.reason))
    m.start()
"""

from monitor.budget import MODES, BudgetEvent, BudgetPolicy
from monitor.known_apps import KnownApps
from monitor.sampling import Monitor
from monitor.snapshot import NO_GPU, GpuSample, ProcessSample, Snapshot
from monitor.units import format_size, parse_size

__all__ = [
    "MODES", "NO_GPU", "BudgetEvent", "BudgetPolicy", "GpuSample", "KnownApps", "Monitor", "ProcessSample",
    "Snapshot", "format_size", "parse_size",
]
