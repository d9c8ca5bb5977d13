"""`python -m monitor`: a live table of GPUs, processes and the budget; `--once --json` prints one snapshot.

Also: `--replay TRACE` (the fake NVML, no GPU needed), `--record FILE --duration S` (write a trace the
tests can replay), `--overhead S` (CPU cost of sampling), `--known-apps` (path of the user's list).
Always exits 0 when there is no NVIDIA GPU: the status says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from monitor.budget import MODES, BudgetEvent, BudgetPolicy
from monitor.units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m monitor", description="Slipstream's VRAM monitor.")
    ap.add_argument("--once", action="store_true", help="take one sample, print it and exit")
    ap.add_argument("--json", action="store_true", help="print JSON (one object per sample)")
    ap.add_argument("--interval", type=float, default=0.1, help="seconds between samples (default 0.1)")
    ap.add_argument("--refresh", type=float, default=0.5, help="seconds between screen updates (default 0.5)")
    ap.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    ap.add_argument("--gpu", type=int, default=0, help="the GPU the budget is for (default 0)")
    ap.add_argument("--mode", choices=MODES, default="auto")
    ap.add_argument("--cap", type=_size, default=None, help="user cap, e.g. 6GiB")
    ap.add_argument("--reserve", type=_size, default=1 << 30, help="kept free for others (default 1GiB)")
    ap.add_argument("--own", type=lambda t: {int(x) for x in t.split(",") if x}, default=set(),
                    metavar="PID,PID", help="pids whose VRAM counts as Slipstream's own")
    ap.add_argument("--replay", metavar="TRACE", help="replay a recorded trace through the fake NVML")
    ap.add_argument("--record", metavar="FILE", help="write what was seen as a replayable trace")
    ap.add_argument("--overhead", type=float, metavar="SECONDS", help="measure the CPU cost of sampling")
    ap.add_argument("--known-apps", action="store_true", help="create/print the user's known-apps file")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.known_apps:
        from monitor.known_apps import ensure_user_file
        print(ensure_user_file())
        return 0
    policy = BudgetPolicy(mode=a.mode, user_cap=a.cap, reserve=a.reserve)
    fake = None
    if a.replay:
        from monitor.fake_nvml import FakeNvml
        fake = FakeNvml(a.replay)
        mon = fake.monitor(interval_s=a.interval, policy=policy, gpu_index=a.gpu)
    else:
        from monitor.sampling import Monitor
        mon = Monitor(interval_s=a.interval, policy=policy, gpu_index=a.gpu)
    mon.set_own_pids(a.own)
    if a.once:
        snap = mon.sample_once()
        if a.json:
            print(json.dumps(snap.as_dict(), indent=1))
        else:
            from monitor.table import render
            print(render(snap))
        return 0
    if a.overhead:
        from monitor.overhead import measure_overhead
        print(json.dumps(measure_overhead(mon, a.overhead), indent=1))
        return 0
    try:
        _live(mon, fake, a)
    except KeyboardInterrupt:
        pass
    finally:
        mon.stop()
    if a.record:
        from monitor.trace import trace_from_snapshots
        with open(a.record, "w", encoding="utf-8") as f:
            json.dump(trace_from_snapshots(mon.history(), name=a.record), f)
        print(f"trace written to {a.record}", file=sys.stderr)
    return 0


def _live(mon, fake, a: argparse.Namespace) -> None:
    from monitor.table import render
    events: list[BudgetEvent] = []
    mon.subscribe(events.append)
    end = time.monotonic() + a.duration if a.duration else float("inf")
    if fake is None:
        mon.start()
    next_draw = 0.0
    while time.monotonic() < end:
        if fake is not None:   # the fake moves one frame per sample, paced in real time
            mon.sample_once()
            if not fake.advance():
                end = 0.0
        now = time.monotonic()
        if now >= next_draw or end == 0.0:
            snap = mon.latest()
            if snap is not None:
                if a.json:
                    print(json.dumps(snap.as_dict()), flush=True)
                else:
                    sys.stdout.write("\x1b[H\x1b[2J" + render(snap, events) + "\n")
                    sys.stdout.flush()
            next_draw = now + a.refresh
        time.sleep(a.interval if fake is not None else min(a.refresh, max(0.0, end - now)))


if __name__ == "__main__":
    sys.exit(main())
