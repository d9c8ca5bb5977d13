"""GPU demo for the VRAM monitor (issue 4): a separate process takes VRAM in steps, the monitor follows.

    python3 docs/benchmarks/scripts/monitor_gpu_demo.py --out DIR          # on the GPU machine (~45 s)
    python3 docs/benchmarks/scripts/monitor_gpu_demo.py --out DIR --dry-run  # anywhere: no GPU, no torch

1. Overhead: a Monitor samples the real NVML at 10 Hz for `--overhead-s` seconds while nothing else runs
   in this process; CPU time of this process / wall time = percent of one core.
2. Timeline: a child process (torch, imported only there) takes 2, 6 and 12 GiB in steps, holds each for
   `--hold-s` seconds, frees it all (del + empty_cache), waits, exits. The Monitor samples at 10 Hz with
   the default budget policy; we record when the child's pid, name and size first appear in a sample,
   and which budget events followed each step.

Writes into --out: monitor_gpu_timeline.json (settings, overhead, markers, checks, events, samples),
monitor_gpu_trace.json (a trace the fake NVML replays: tests/monitor can use it as a recorded trace) and
monitor_gpu_timeline.png where matplotlib is installed. Prints a summary table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))   # the repository root

from monitor import BudgetPolicy, Monitor, format_size
from monitor.overhead import measure_overhead
from monitor.trace import trace_from_snapshots

GiB = 1 << 30


def child(steps: list[int], hold_s: float, events: mp.Queue, held: mp.Value | None) -> None:
    """The stand-in for a game. `held` is set in --dry-run, where no GPU is touched."""
    blocks: list = []
    if held is None:
        import torch
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        events.put(("ready", time.monotonic(), 0, torch.__version__))
    else:
        events.put(("ready", time.monotonic(), 0, "dry-run"))
    have = 0
    for target in steps:
        if held is None:
            blocks.append(torch.empty((target - have) * GiB, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
        else:
            held.value = target * GiB
        have = target
        events.put(("holding", time.monotonic(), target * GiB, ""))
        time.sleep(hold_s)
    if held is None:
        blocks.clear()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    else:
        held.value = 0
    events.put(("freed", time.monotonic(), 0, ""))
    time.sleep(hold_s + 1.0)   # alive with only its context: the release is seen apart from the exit
    events.put(("exiting", time.monotonic(), 0, ""))


class DryNvml:
    """--dry-run: a one-GPU NVML whose only process is the child, holding what it says it holds."""

    class NVMLError(Exception):
        pass

    def __init__(self, held: mp.Value) -> None:
        self.held, self.pid = held, None

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return 1
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i
    def nvmlDeviceGetName(self, h: int) -> str: return "dry-run GPU"
    def nvmlDeviceGetUtilizationRates(self, h: int): return SimpleNamespace(gpu=0)
    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int: return 5
    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int: return 16
    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list: return []

    def nvmlDeviceGetMemoryInfo(self, h: int):
        used = (500 << 20) + (self.held.value + (500 << 20) if self.pid else 0)
        return SimpleNamespace(total=139 * GiB, used=used, free=139 * GiB - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        if not self.pid:
            return []
        return [SimpleNamespace(pid=self.pid, usedGpuMemory=self.held.value + (500 << 20))]


def run_overhead(nvml, seconds: float) -> dict:
    mon = Monitor(interval_s=0.1, nvml=nvml)
    first = mon.sample_once()   # NVML init and the first look-ups happen outside the measured window
    out = measure_overhead(mon, seconds)
    out["status"] = first.status
    out["processes_seen"] = len(first.processes)
    mon.close()
    return out


def run_timeline(args: argparse.Namespace, nvml, held) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mon = Monitor(interval_s=0.1, nvml=nvml, policy=BudgetPolicy())
    events = []
    mon.subscribe(events.append)
    mon.start()
    time.sleep(1.0)
    proc = ctx.Process(target=child, args=(args.steps, args.hold_s, q, held), daemon=True)
    proc.start()
    if isinstance(nvml, DryNvml):
        nvml.pid = proc.pid
    markers, deadline = [], time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        try:
            m = q.get(timeout=1.0)
        except Exception:  # noqa: BLE001 - queue.Empty; check the child is alive and go on
            if not proc.is_alive():
                break
            continue
        markers.append({"what": m[0], "t": m[1], "bytes": m[2], "info": m[3]})
        if m[0] == "exiting":
            break
    proc.join(timeout=10)
    time.sleep(1.5)   # see the exit too
    mon.stop()
    snaps = mon.history()
    return {"pid": proc.pid, "markers": markers, "events": events, "snaps": snaps, "stats": mon.stats()}


def analyse(pid: int, markers: list[dict], events: list, snaps: list) -> list[dict]:
    """Per marker: when a sample first showed it (pid, name, size) and the first budget event after it."""
    rows = []
    for i, m in enumerate(markers):
        if m["what"] not in ("holding", "freed"):
            continue
        want = m["bytes"]
        until = markers[i + 1]["t"] if i + 1 < len(markers) else float("inf")

        def shows(s, want=want):
            p = next((p for p in s.processes if p.pid == pid), None)
            if p is None or p.vram_bytes is None:
                return None
            ok = p.vram_bytes >= want if want else p.vram_bytes < GiB
            return p if ok else None
        seen = next(((s, shows(s)) for s in snaps if s.time >= m["t"] - 0.2 and shows(s)), (None, None))
        # The last budget event before the next step (the child's CUDA context may cause one just before).
        ev = next((e for e in reversed(events) if m["t"] - 0.15 <= e.time < until and e.previous is not None),
                  None)
        rows.append({
            "step": f"{m['what']} {format_size(want)}" if want else "freed",
            "marker_t": m["t"],
            "seen_after_ms": round(1000 * (seen[0].time - m["t"]), 1) if seen[0] else None,
            "pid": seen[1].pid if seen[1] else None, "name": seen[1].name if seen[1] else None,
            "exe": seen[1].exe if seen[1] else None, "vram_bytes": seen[1].vram_bytes if seen[1] else None,
            "event_after_ms": round(1000 * (ev.time - m["t"]), 1) if ev else None,
            "budget": ev.budget if ev else None, "previous": ev.previous if ev else None,
            "reason": ev.reason if ev else None,
        })
    return rows


def plot(path: Path, t0: float, snaps: list, pid: int, markers: list[dict], events: list) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [s for s in snaps if s.gpu is not None]
    t = [s.time - t0 for s in ok]
    child_vram = [next((p.vram_bytes or 0 for p in s.processes if p.pid == pid), 0) / GiB for s in ok]
    fig, (top, low) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(t, [s.gpu.used / GiB for s in ok], label="device used", drawstyle="steps-post")
    top.plot(t, [s.others_vram / GiB for s in ok], ":", label="others (used - ours)", drawstyle="steps-post")
    top.plot(t, child_vram, label=f"child pid {pid} (per-process)", drawstyle="steps-post")
    top.set_ylabel("GiB")
    top.legend(loc="center right", fontsize=8)
    low.plot(t, [(s.budget or 0) / GiB for s in ok], color="tab:red", label="budget", drawstyle="steps-post")
    low.plot([e.time - t0 for e in events], [(e.budget or 0) / GiB for e in events], "kv", ms=5,
             label="budget event")
    low.set_ylabel("budget, GiB")
    low.set_xlabel("seconds")
    low.legend(loc="lower left", fontsize=8)
    for m in markers:
        if m["what"] == "ready":
            continue
        for ax in (top, low):
            ax.axvline(m["t"] - t0, color="grey", lw=0.6)
        top.text(m["t"] - t0, top.get_ylim()[1] * 0.97, m["what"] + (f" {m['bytes'] // GiB}G" if m["bytes"] else ""),
                 rotation=90, va="top", ha="right", fontsize=7, color="grey")
    top.set_title("Slipstream monitor at 10 Hz: another process takes 2, 6, 12 GiB, then frees and exits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    ap.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 6, 12],
                    help="GiB held at each step, cumulative (default 2,6,12)")
    ap.add_argument("--hold-s", type=float, default=4.0, help="seconds at each step (default 4)")
    ap.add_argument("--overhead-s", type=float, default=10.0, help="seconds of the overhead measurement")
    ap.add_argument("--timeout-s", type=float, default=90.0)
    ap.add_argument("--dry-run", action="store_true", help="no GPU, no torch: a fake NVML the child drives")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    held = mp.get_context("spawn").Value("q", 0) if args.dry_run else None
    nvml = DryNvml(held) if args.dry_run else None

    overhead = run_overhead(DryNvml(held) if args.dry_run else None, args.overhead_s)
    print(f"overhead at 10 Hz: {overhead['cpu_percent_of_one_core']:.3f}% of one core, "
          f"{overhead['mean_sample_ms']:.3f} ms per sample ({overhead['samples']} samples, {overhead['status']})")
    r = run_timeline(args, nvml, held)
    snaps, pid = r["snaps"], r["pid"]
    t0 = snaps[0].time if snaps else 0.0
    rows = analyse(pid, r["markers"], r["events"], snaps)
    first_ok = next((s for s in snaps if s.gpu is not None), None)
    driver = "n/a"
    if not args.dry_run:
        try:
            import pynvml
            driver = pynvml.nvmlSystemGetDriverVersion()
        except Exception as exc:  # noqa: BLE001 - informational only
            driver = f"n/a ({exc})"
    out = {
        "what": "monitor GPU demo (issue 4): a separate process takes VRAM in steps; the monitor follows",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "dry_run": args.dry_run,
        "machine": {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
                    "gpu": first_ok.gpu.name if first_ok else None,
                    "gpu_total": first_ok.gpu.total if first_ok else None,
                    "pcie": [first_ok.gpu.pcie_gen, first_ok.gpu.pcie_width] if first_ok else None,
                    "driver": driver,
                    "torch": next((m["info"] for m in r["markers"] if m["what"] == "ready"), None)},
        "settings": {"interval_s": 0.1, "steps_gib": args.steps, "hold_s": args.hold_s,
                     "policy": {"reserve": 1 << 30, "hold_s": 3.0, "hysteresis": 512 << 20, "slack": 128 << 20}},
        "overhead": overhead,
        "monitor_stats": r["stats"],
        "child_pid": pid,
        "markers": [{**m, "t": round(m["t"] - t0, 3)} for m in r["markers"]],
        "checks": [{**row, "marker_t": round(row["marker_t"] - t0, 3)} for row in rows],
        "events": [{**e.as_dict(), "time": round(e.time - t0, 3)} for e in r["events"]],
        "samples": [{"t": round(s.time - t0, 3), "status": s.status,
                     "used": s.gpu.used if s.gpu else None, "others": s.others_vram, "budget": s.budget,
                     "child": next((p.vram_bytes for p in s.processes if p.pid == pid), None),
                     "pids": [p.pid for p in s.processes]} for s in snaps],
    }
    (args.out / "monitor_gpu_timeline.json").write_text(json.dumps(out, indent=1) + "\n")
    trace = trace_from_snapshots(snaps, "gpu_steps", "recorded by monitor_gpu_demo.py: a process takes "
                                 f"{args.steps} GiB in steps, then frees")
    (args.out / "monitor_gpu_trace.json").write_text(json.dumps(trace) + "\n")
    png = plot(args.out / "monitor_gpu_timeline.png", t0, snaps, pid, r["markers"], r["events"])

    print(f"GPU: {out['machine']['gpu']}  driver {driver}  torch {out['machine']['torch']}  child pid {pid}")
    print(f"{'step':<16} {'seen after':>10} {'pid':>8} {'name':<16} {'VRAM':>10} {'event after':>11} "
          f"{'budget':>10}  reason")
    for row in rows:
        seen = f"{row['seen_after_ms']} ms" if row["seen_after_ms"] is not None else "NOT SEEN"
        ev = f"{row['event_after_ms']} ms" if row["event_after_ms"] is not None else "none"
        print(f"{row['step']:<16} {seen:>10} {row['pid'] or '-':>8} {(row['name'] or '-')[:16]:<16} "
              f"{format_size(row['vram_bytes']):>10} {ev:>11} {format_size(row['budget']):>10}  {row['reason']}")
    print(f"{len(r['events'])} budget events, {len(snaps)} samples; wrote {args.out}/monitor_gpu_timeline.json"
          + (", monitor_gpu_timeline.png" if png else " (no matplotlib: no PNG)") + ", monitor_gpu_trace.json")
    missing = [row["step"] for row in rows if row["seen_after_ms"] is None]
    if missing:
        seen_pids = sorted({p for s in snaps for p in (q.pid for q in s.processes)})
        print(f"WARNING: child pid {pid} not seen for {missing}; pids NVML listed: {seen_pids} "
              "(a PID namespace hides the child's real pid?)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
