"""Host time of each kind of sub-layer in decode, as the engine runs it, beside the estimator's price.

    python -m engine.bench.host_costs --shape smollm2-135m --budget 60GiB --kinds gpu_only,static --out DIR
    python -m engine.bench.host_costs --device sim --shape tiny-moe --budget 6MiB --out /tmp/x   (dry run)

For each forced plan kind, N decode tokens (sampled, after a random-byte prompt) run with the executor's
sub-layer timer on (`Executor.sublayer_times`: perf_counter at each sub-layer's start, no profiler), and
the table gives per "placement/kind" (e.g. `resident/attn`, `cpu/ffn`, `cpu/router`): how many ran per
step, their mean host milliseconds, and the estimator's milliseconds for the same sub-layers (the GPU
side's cost is what the host pays to issue them, or their kernels where longer; a crossing's move counts
in the sub-layer that needs it, here and in the estimator alike). The ratio is the calibration the
estimator's per-op prices need (session 7: a MoE decode ran at about 2x its prediction, and
SmolLM2-135M's CPU sub-layers at about 4.5x).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.bench.scenarios import DRY_SCENARIOS, SCENARIOS, Scenario
from engine.units import parse_bytes

SHAPE_SCENARIOS = {"smollm2-135m": Scenario("smollm2-135m", "dense", "smollm2-135m")}


def predicted_by_kind(eng, ctx: int) -> dict[str, float]:
    """The estimator's milliseconds per "placement/kind" (summed over a step) for the tier-1 plan in force."""
    ex = eng.executor
    costs = eng.planner().estimator.costs(1, ctx)
    out: dict[str, float] = {}
    for i, s in enumerate(eng.spec.sublayers):
        key = ex._time_key(s.name)
        ms = costs.cpu_ms[i] if ex.plan.placement[s.name].value == "cpu" else costs.gpu_ms[i]
        out[key] = out.get(key, 0.0) + float(ms)
    return out


def measure_kind(eng, kind: str, tokens: int) -> dict:
    from engine.bench.decode_steps import token_times
    from engine.bench.slipstream_runs import _prompt

    eng.force_plan(kind)
    token_times(eng, _prompt(32, 90), 4)                      # warm-up on this plan
    ex = eng.executor
    times, last = [], None
    t0 = time.perf_counter()
    for ev in eng.generate(_prompt(32, 91), max_new_tokens=tokens + 1, temperature=1.0, seed=91):
        if ev.token_id is None:
            continue
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        else:
            ex.sublayer_times = {}               # from the first decode step on (the prompt's step is not)
        last = now
    measured, ex.sublayer_times = ex.sublayer_times or {}, None
    wall = time.perf_counter() - t0
    steps = max(len(times), 1)
    predicted = predicted_by_kind(eng, 32 + tokens // 2)
    tier = eng.plan_report()["tiers"][0]
    rows = []
    for key in sorted(set(measured) | set(predicted)):
        n, sec = measured.get(key, (0, 0.0))
        rows.append({"kind": key, "per_step": n / steps, "measured_ms_each": sec / n * 1e3 if n else None,
                     "predicted_ms_per_step": predicted.get(key, 0.0), "measured_ms_per_step": sec / steps * 1e3})
    return {"kind": kind, "plan": tier["plan"], "predicted_step_ms": tier["predicted_ms"],
            "median_token_ms": statistics.median(times) * 1e3 if times else None, "wall_s": wall, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--budget", default="60GiB")
    ap.add_argument("--kinds", default="auto,gpu_only,static")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers of the shape (0: all)")
    ap.add_argument("--device", default="cuda", help="cuda, cpu, or sim (a dry run on this machine)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    from engine.bench.slipstream_runs import open_engine

    scenarios = {**SCENARIOS, **DRY_SCENARIOS, **SHAPE_SCENARIOS}
    if args.shape not in scenarios:
        raise SystemExit(f"--shape: unknown {args.shape!r}; known: {', '.join(scenarios)}")
    scenario = scenarios[args.shape]
    if args.layers:
        scenario = dataclasses.replace(scenario, layers=args.layers)
    eng = open_engine(scenario, parse_bytes(args.budget), args.device, 1024)
    results = []
    try:
        for kind in args.kinds.split(","):
            r = measure_kind(eng, kind, args.tokens)
            results.append(r)
            pred = r["predicted_step_ms"]
            print(f"== {args.shape} {args.budget} {kind} ({r['plan']}): median {r['median_token_ms']:.2f} ms per "
                  f"token, predicted " + (f"{pred:.2f}" if math.isfinite(pred) and pred else "- (no GPU: no plan prices)"))
            print("| placement/kind | per step | measured ms each | measured ms per step | predicted ms per step |"
                  " measured / predicted |")
            print("|---|---|---|---|---|---|")
            for row in r["rows"]:
                each = "-" if row["measured_ms_each"] is None else f"{row['measured_ms_each']:.3f}"
                pred = row["predicted_ms_per_step"]
                ratio = f"{row['measured_ms_per_step'] / pred:.2f}" if pred > 0 else "-"
                print(f"| {row['kind']} | {row['per_step']:.1f} | {each} | {row['measured_ms_per_step']:.2f} | "
                      f"{pred:.2f} | {ratio} |")
    finally:
        eng.close()
    write_report(args.out, "host_costs", {"shape": args.shape, "budget": args.budget, "results": results},
                 "python -m engine.bench.host_costs " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
