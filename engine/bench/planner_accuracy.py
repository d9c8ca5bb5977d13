"""How well the estimator predicts, and how often the planner picks the fastest plan, on this GPU.

For each budget and token tier, every plan kind is forced in turn and one step of that many new tokens
is timed (median of a few, after a warm-up); the prediction for the same plan is recorded beside it.

    python -m engine.bench.planner_accuracy --shape llama3-8b --budgets 2GiB,4GiB,8GiB --out DIR

The budget is the engine's own VRAM accounting (standing in for a client GPU); configurations whose
prediction exceeds --max-pred-s are skipped and listed as such.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import open_shape, write_report
from engine.errors import BudgetError
from engine.sharding.kvcache import Sequence
from engine.units import parse_bytes

KINDS = ("gpu_only", "static", "dynamic")


def time_step(eng, plan, n_tokens: int, ctx: int, reps: int) -> float:
    """Median seconds of one step of `n_tokens` after `ctx` cached tokens, under `plan`."""
    ex = eng.executor
    times = []
    for _ in range(reps + 1):
        seq = Sequence()
        try:
            if ctx:
                ex.kv.reserve(seq, ctx)
                seq.length = ctx          # the cache's contents do not change the step's cost
            if plan is not ex.plan:
                ex.activate(plan)
            if eng.accel is not None:
                eng.accel.synchronize()
            t0 = time.perf_counter()
            ex.forward(seq, [7] * n_tokens, False)
            if eng.accel is not None:
                eng.accel.synchronize()
            times.append(time.perf_counter() - t0)
        finally:
            ex.kv.release(seq)
    return statistics.median(times[1:])


@torch.inference_mode()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budgets", default="2GiB,4GiB,8GiB")
    ap.add_argument("--tiers", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--ctx", type=int, default=512, help="cached tokens before a decode-tier step")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-pred-s", type=float, default=6.0)
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers of the shape (0: all)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="plan kinds to force, comma-separated")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    tiers = [int(t) for t in args.tiers.split(",")]
    eng = open_shape(args.shape, budgets[0], n_ctx=max(tiers) + args.ctx + 16, layers=args.layers)
    eng.kv_tokens = eng._kv_capacity(max(tiers) + args.ctx)
    torch.cuda.set_per_process_memory_fraction(1.0)   # budgets here are bookings, not the whole process
    planner = eng.planner()
    rows = []
    for budget in budgets:
        chosen = planner.plan(budget, kv_tokens=eng.kv_tokens)
        eng.accel.budget = max(eng.accel.budget, budget)
        for kind in args.kinds.split(","):
            try:
                ps = planner.plan(budget, kv_tokens=eng.kv_tokens, force_kind=kind)
            except BudgetError as exc:  # a kind that cannot fit this budget
                print(f"{budget >> 20} MiB {kind}: no plan ({exc})", file=sys.stderr)
                continue
            eng.planset = ps
            eng.executor.activate(ps.for_tokens(1))
            eng.accel.budget = budget
            for tier in tiers:
                plan = ps.for_tokens(tier)
                ctx = args.ctx if tier < 64 else 0
                pred = planner.estimate(plan, tier, ctx + tier)
                row = {"budget": budget, "kind": kind, "tier": tier, "predicted_ms": pred,
                       "chosen_kind": chosen.for_tokens(tier).kind, "vram_total": plan.vram.total}
                if pred > args.max_pred_s * 1e3:
                    row["measured_ms"] = None
                    row["skipped"] = "prediction above --max-pred-s"
                else:
                    row["measured_ms"] = time_step(eng, plan, tier, ctx, args.reps) * 1e3
                row["peak_booked"] = eng.accel.peak
                rows.append(row)
                print(f"{budget / 2**30:4.1f} GiB {kind:9s} tier {tier:5d}: predicted {pred:9.1f} ms, "
                      f"measured {row['measured_ms'] or float('nan'):9.1f} ms", flush=True)
    eng.close()
    summary = summarize(rows)
    path = write_report(Path(args.out), "planner_accuracy", {"rows": rows, "summary": summary},
                        " ".join(["python -m engine.bench.planner_accuracy"] + (argv or sys.argv[1:])))
    print(summary)
    print(f"wrote {path}")
    return 0


def summarize(rows: list[dict]) -> dict:
    measured = [r for r in rows if r.get("measured_ms")]
    errs = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in measured]
    configs = {}
    for r in measured:
        configs.setdefault((r["budget"], r["tier"]), []).append(r)
    within, total = 0, 0
    for rs in configs.values():
        best = min(r["measured_ms"] for r in rs)
        pick = [r for r in rs if r["kind"] == r["chosen_kind"]]
        if not pick:
            continue
        total += 1
        within += pick[0]["measured_ms"] <= best * 1.05
    return {"median_abs_rel_error": statistics.median(errs) if errs else None,
            "configs": total, "chosen_within_5pct": within,
            "chosen_within_5pct_fraction": within / total if total else None}


if __name__ == "__main__":
    sys.exit(main())
