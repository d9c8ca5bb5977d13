"""Live re-planning on the GPU: a budget drop mid-generation, how fast VRAM goes back to the driver
(seen by NVML), and decode speed after the drop against a fresh engine opened at the lower budget.

    python -m engine.bench.replan_yield --shape llama3-8b --high 8GiB --low 2GiB --out DIR

The budget is the engine's own accounting standing in for a client GPU's free VRAM; NVML's figure for
this process (which also holds the CUDA context) is recorded beside it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from engine.bench.gpu_common import NvmlPoller, open_shape, write_report
from engine.units import parse_bytes

PROMPT_TOKENS = 64


def decode_rate(eng, n_tokens: int, skip: int = 3) -> float:
    stamps = []
    for ev in eng.generate("x" * PROMPT_TOKENS, max_new_tokens=n_tokens):
        if ev.token_id is not None:
            stamps.append(time.perf_counter())
    stamps = stamps[skip:]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def drop_seen(samples, t_call: float, before: int, settled: int):
    """The first NVML sample after the call showing 90% of the eventual drop (None if none did)."""
    threshold = before - 0.9 * (before - settled)
    return next((s for s in samples if s[0] >= t_call and s[1] <= threshold), None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--high", default="8GiB")
    ap.add_argument("--low", default="2GiB")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    high, low = parse_bytes(args.high), parse_bytes(args.low)

    eng = open_shape(args.shape, high)
    list(eng.generate("x" * PROMPT_TOKENS, max_new_tokens=4))          # warm up
    with NvmlPoller(0.002) as poll:
        stamps: list[float] = []
        drop_at = {}

        def gen():
            for ev in eng.generate("x" * PROMPT_TOKENS, max_new_tokens=args.tokens * 2):
                if ev.token_id is not None:
                    stamps.append(time.perf_counter())

        t = threading.Thread(target=gen)
        t.start()
        while len(stamps) < args.tokens // 2:
            time.sleep(0.001)
        before = poll.sample()
        drop_at["call"] = time.perf_counter()
        eng.set_vram_budget(low)                 # from this (non-generating) thread, mid-generation
        drop_at["returned"] = time.perf_counter()
        t.join()
    own_before = before[1]
    settled = poll.samples[-1][1]                     # this process's VRAM once the drop has settled
    seen = drop_seen(poll.samples, drop_at["call"], own_before, settled)
    replan = eng.replans[-1]
    after = [s for s in stamps if s > drop_at["call"]][3:]
    rate_after = (len(after) - 1) / (after[-1] - after[0]) if len(after) > 2 else float("nan")
    report_live = eng.plan_report()
    eng.close()
    eng = None

    fresh = open_shape(args.shape, low)
    list(fresh.generate("x" * PROMPT_TOKENS, max_new_tokens=4))
    rate_fresh = decode_rate(fresh, args.tokens)
    report_fresh = fresh.plan_report()
    fresh.close()

    rows = {
        "shape": args.shape, "high_budget": high, "low_budget": low,
        "nvml_own_before_bytes": own_before,
        "nvml_own_after_bytes": settled,
        "ms_call_to_nvml_drop": (seen[0] - drop_at["call"]) * 1e3 if seen else None,
        "ms_set_vram_budget_call": (drop_at["returned"] - drop_at["call"]) * 1e3,
        "engine_replan_ms": replan["replan_ms"],
        "decode_tps_after_drop": rate_after, "decode_tps_fresh_at_low": rate_fresh,
        "after_vs_fresh": rate_after / rate_fresh,
        "plan_after_drop": [t["plan"] for t in report_live["tiers"]],
        "plan_fresh": [t["plan"] for t in report_fresh["tiers"]],
        "nvml_timeline": [(round((s[0] - drop_at["call"]) * 1e3, 2), s[1]) for s in poll.samples
                          if -200 <= (s[0] - drop_at["call"]) * 1e3 <= 1000][::5],
    }
    path = write_report(Path(args.out), "replan_yield", rows, " ".join(["python -m engine.bench.replan_yield"] +
                                                                        (argv or sys.argv[1:])))
    print("| measure | value |\n|---|---|")
    for k, v in rows.items():
        if k != "nvml_timeline":
            print(f"| {k} | {v} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
