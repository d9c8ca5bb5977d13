"""The live terminal view of `python -m monitor`: GPUs, processes, the budget and recent events, as text."""

from __future__ import annotations

import time

from monitor.budget import BudgetEvent
from monitor.snapshot import Snapshot
from monitor.units import format_size


def render(snap: Snapshot, events: list[BudgetEvent] | None = None, width: int = 100) -> str:
    clock = time.strftime("%H:%M:%S", time.localtime(snap.wall_time))
    lines = [f"Slipstream monitor  {clock}  status: {snap.status}"]
    for g in snap.gpus:
        util = f"{g.utilization}%" if g.utilization is not None else "n/a"
        link = f"PCIe {g.pcie_gen}.0 x{g.pcie_width}" if g.pcie_gen and g.pcie_width else "PCIe n/a"
        lines.append(f"GPU {g.index}  {g.name}  used {format_size(g.used)} / {format_size(g.total)}  "
                     f"free {format_size(g.free)}  util {util}  {link}")
    if snap.budget is not None or snap.gpus:
        state = "paused (gaming)" if snap.paused else ("gaming" if snap.gaming else "no game")
        lines.append(f"budget {format_size(snap.budget)}  mode {snap.mode}  {state}  "
                     f"ours {format_size(snap.own_vram)}  others {format_size(snap.others_vram)}")
    if snap.gpus:
        lines.append("")
        lines.append(f"{'GPU':>3} {'PID':>8} {'VRAM':>10}  {'TYPE':<8} {'WHO':<6} NAME / WHY")
    for p in sorted(snap.processes, key=lambda p: (p.gpu_index, -(p.vram_bytes or 0), p.pid)):
        kind = "+".join(sorted(k[0].upper() for k in p.kinds))
        who = "ours" if p.is_own else ("game" if p.is_game else "")
        why = f"  [{p.reason}]" if p.reason else ""
        vram = format_size(p.vram_bytes) if p.vram_bytes is not None else "n/a"
        lines.append(f"{p.gpu_index:>3} {p.pid:>8} {vram:>10}  {kind:<8} {who:<6} {p.label}{why}"[:width])
    if snap.gpus and not snap.processes:
        lines.append("    (no processes on the GPU)")
    for note in snap.notes:
        lines.append(f"note: {note}"[:width])
    if events:
        lines.append("")
        lines.append("recent budget events:")
        for e in events[-5:]:
            lines.append(f"  {format_size(e.previous):>9} -> {format_size(e.budget):<9} {e.reason}"[:width])
    return "\n".join(lines)
