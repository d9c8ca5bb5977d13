"""Slipstream in auto mode beside the game stand-in: the monitor's budget policy drives the engine.

    python -m engine.bench.corun_slipstream --model llama3-8b --cap 24GiB --log slip.jsonl --stop-file F

As the app wires it: `Monitor(policy=BudgetPolicy(mode="auto", reserve=..., total_cap=cap))`, and every
budget event goes to `engine.set_vram_budget` (from the monitor's thread; mid-generation it applies at the
next sub-layer boundary). The engine opens at the budget of the monitor's first sample, then runs a
chat-like loop (a 64-token prompt, 128 new tokens, again) until the stop file appears.

`--overhead none` passes the policy's budget as is (the app's wiring today). The engine's budget covers
what it books (weights, KV, slots, scratch), while NVML also counts its CUDA context and the allocator's
cache, which the policy's room formula does not subtract: `--overhead measured` passes the budget less
that overhead (the median over 2 s of NVML own bytes - booked bytes; 1 GiB until measured).

Log (JSON lines): budget events, a token record every 0.5 s {t, tokens (stamps in the window)}, a VRAM
sample every 0.25 s {t, nvml_own, budget, engine_booked}, the engine's re-plans, errors (a CUDA
out-of-memory included) and a summary. With `--sim-dir` it runs a tiny shape on the "sim" device against
a simulated card, publishing its booked bytes (plus `--sim-context`) as its VRAM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from engine.units import parse_bytes


class Log:
    def __init__(self, path: str | None):
        self.f = open(path, "w") if path else None  # noqa: SIM115 - open for the process's life
        self.lock = threading.Lock()

    def __call__(self, rec: dict) -> None:
        if self.f:
            with self.lock:
                self.f.write(json.dumps(rec, default=str) + "\n")
                self.f.flush()


def make_monitor(args, nvml):
    from monitor import BudgetPolicy, Monitor

    policy = BudgetPolicy(mode="auto", reserve=args.reserve, total_cap=args.cap, hold_s=args.hold_s,
                          hysteresis=args.hysteresis, slack=args.slack)
    return Monitor(interval_s=args.interval, policy=policy, nvml=nvml)


def run(args) -> dict:
    from engine.bench.scenarios import DRY_SCENARIOS, SCENARIOS
    from engine.bench.slipstream_runs import open_engine

    log = Log(args.log)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sim = None
    if args.sim_dir:
        from engine.bench.simcard import SimCard

        sim = SimCard(args.sim_dir)
        sim.set_own(parse_bytes(args.sim_context), "corun_slipstream")
    monitor = make_monitor(args, sim)
    monitor.sample_once()
    first = monitor.last_event()
    budget0 = first.budget if first and first.budget is not None else 0
    log({"event": "budget", "t": time.time(), "budget": budget0, "reason": first.reason if first else "none"})
    scenario = (DRY_SCENARIOS if sim else SCENARIOS)[args.model]
    t0 = time.time()
    eng = open_engine(scenario, budget0, "sim" if sim else "cuda", n_ctx=1024)
    log({"event": "opened", "t": time.time(), "seconds": time.time() - t0, "budget": budget0})
    first_guess = parse_bytes(args.overhead_initial)
    step = parse_bytes(args.overhead_step)
    if args.force_plan != "auto":
        eng.force_plan(args.force_plan)
    if args.overhead == "measured":
        eng.set_vram_budget(max(0, budget0 - first_guess))
    events: list[dict] = []

    overhead = {"bytes": first_guess if args.overhead == "measured" else 0, "last_policy": budget0}

    def apply(policy_budget: int) -> int:
        b = max(0, policy_budget - overhead["bytes"])
        eng.set_vram_budget(b)
        return b

    def on_budget(ev) -> None:
        p = 0 if ev.budget is None else ev.budget
        overhead["last_policy"] = p
        b = apply(p)
        rec = {"event": "budget", "t": time.time(), "budget": b, "policy_budget": p, "previous": ev.previous,
               "reason": ev.reason, "overhead": overhead["bytes"]}
        events.append(rec)
        log(rec)

    monitor.subscribe(on_budget)
    monitor.start()
    stop = threading.Event()
    stop_file = Path(args.stop_file) if args.stop_file else None

    recent: list[int] = []

    def vram_sampler() -> None:
        me = os.getpid()
        while not stop.is_set():
            acc = eng.accel
            booked = acc.total_used if acc is not None else 0
            if sim is not None:
                sim.set_own(booked + parse_bytes(args.sim_context), "corun_slipstream")
            snap = monitor.latest()
            own = next((p.vram_bytes for p in (snap.processes if snap else ()) if p.pid == me), None)
            if args.overhead == "measured" and own is not None and acc is not None:
                recent.append(own - booked)
                del recent[:-8]
                seen = sorted(recent)[len(recent) // 2]          # median of 2 s: transients do not latch
                if len(recent) >= 4 and abs(seen - overhead["bytes"]) > step:
                    overhead["bytes"] = seen
                    b = apply(overhead["last_policy"])
                    log({"event": "budget", "t": time.time(), "budget": b, "policy_budget": overhead["last_policy"],
                         "reason": "measured overhead", "overhead": seen})
            log({"t": time.time(), "nvml_own": own, "budget": eng.budget, "engine_booked": booked})
            stop.wait(0.25)

    sampler = threading.Thread(target=vram_sampler, daemon=True)
    sampler.start()
    stamps: list[float] = []
    errors = 0
    turn = 0
    ready_written = False
    window_t0 = time.time()
    while not stop.is_set():
        if stop_file is not None and stop_file.exists():
            break
        if args.max_s and time.time() - t0 > args.max_s:
            break
        prompt = chr(ord("A") + turn % 26) + "y" * (args.prompt_tokens - 1)
        turn += 1
        try:
            for ev in eng.generate(prompt, max_new_tokens=args.new_tokens):
                if ev.token_id is None:
                    continue
                now = time.time()
                stamps.append(now)
                if not ready_written and args.ready_file:
                    Path(args.ready_file).write_text(str(os.getpid()))
                    ready_written = True
                if now - window_t0 >= 0.5:
                    n = sum(1 for s in stamps if s >= window_t0)
                    log({"t": now, "tokens": n, "window_s": now - window_t0})
                    window_t0 = now
                if stop_file is not None and stop_file.exists():
                    break
        except Exception as exc:  # noqa: BLE001 - an error (CUDA OOM included) is a result; go on
            errors += 1
            log({"event": "error", "t": time.time(), "kind": type(exc).__name__, "message": str(exc)[:500],
                 "oom": "OutOfMemory" in type(exc).__name__ or "out of memory" in str(exc).lower()})
            time.sleep(0.5)
    stop.set()
    sampler.join()
    monitor.close()
    replans = list(eng.replans)
    eng.close()
    if sim is not None:
        sim.clear_own()
    summary = {"event": "end", "t": time.time(), "tokens": len(stamps), "turns": turn, "errors": errors,
               "budget_events": len(events), "replans": replans}
    log(summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cap", default="24GiB")
    ap.add_argument("--reserve", default="1GiB")
    ap.add_argument("--interval", type=float, default=0.1, help="monitor sampling interval (s)")
    ap.add_argument("--hold-s", type=float, default=3.0)
    ap.add_argument("--hysteresis", default="512MiB")
    ap.add_argument("--slack", default="128MiB")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--log", default=None)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--max-s", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--overhead", choices=("none", "measured"), default="none",
                    help="subtract the engine's measured non-budget VRAM from the policy's budget")
    ap.add_argument("--overhead-initial", default="1GiB", help="the overhead assumed until measured")
    ap.add_argument("--overhead-step", default="64MiB", help="re-apply when the measured overhead moves more")
    ap.add_argument("--force-plan", default="auto", help="a plan kind for every tier (dry runs: gpu_only)")
    ap.add_argument("--sim-dir", default=None)
    ap.add_argument("--sim-context", default="0")
    args = ap.parse_args(argv)
    print(json.dumps(run(args), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
