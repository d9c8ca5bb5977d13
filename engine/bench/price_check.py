"""The estimator's price of each kind of sub-layer beside the host time the executor measured for it.

    python -m engine.bench.price_check docs/benchmarks/gpu/session21/callac/x/4GiB/share_ab.json \
        --profile-file docs/benchmarks/profiles/h200.json [--part decode] [--ctx 96]

Reads a `share_ab --host-times` report (its shape; per round the executor's sub-layer timer: placement/kind
-> [count, mean ms]) and prices every kind with `estimator.step_costs` at the step's tokens (1 for decode, 4
or 16 for the batches) on the given profile: a CPU sub-layer at its CPU price, a GPU one at its GPU price
(the launch of a streamed one, whose copy the step waits for elsewhere). Prints per kind the measured mean
(median over rounds), the price, their ratio, and both per step. The timer's wall time runs from one
sub-layer's start to the next one's, so a kind's time holds the waits before the next sub-layer (a CPU
attention after a GPU FFN waits for that FFN). A MoE layer run whole (one native call on the CPU,
`moe.layer_cpu`; or from VRAM) shows up under its router alone: where a placement's expert groups show up on
their own fewer times than its routers (in a prompt's step, say), its router's row is priced with its
layer's groups.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

PART_TOKENS = {"decode": 1, "batch4": 4, "batch16": 16}


def kind_prices(spec, prof, n_tokens: int, ctx: int) -> dict[str, float]:
    """placement/kind -> the mean price (ms) of that kind's sub-layers on that side, at `n_tokens`; for a MoE
    router also "<place>/router+experts": the router with its layer's expert groups (a layer run whole, in
    one call on the CPU or from VRAM, shows up in the timer under its router alone)."""
    from engine.sharding.estimator import step_costs

    costs = step_costs(spec, prof, n_tokens, ctx)
    sums: dict[str, list[float]] = {}
    for i, sub in enumerate(spec.sublayers):
        groups = [j for j, s in enumerate(spec.sublayers) if s.kind == "experts" and s.layer == sub.layer] \
            if sub.kind == "router" else []
        for place, side in (("cpu", costs.cpu_ms), ("resident", costs.gpu_ms), ("streamed", costs.gpu_ms)):
            sums.setdefault(f"{place}/{sub.kind}", []).append(float(side[i]))
            if groups:
                sums.setdefault(f"{place}/router+experts", []).append(float(side[i] + sum(side[j] for j in groups)))
    return {k: sum(v) / len(v) for k, v in sums.items()}


def compare(report: dict, part: str, prof, ctx: int) -> list[dict]:
    from engine.bench.scenarios import DRY_SCENARIOS, SCENARIOS
    from engine.sharding.spec import ModelSpec

    key = "host_ms" if part == "decode" else f"{part}_host_ms"
    rounds = [r[key] for r in report["rounds"] if r.get(key)]
    if not rounds:
        raise SystemExit(f"no {key} in the report: run share_ab with --host-times (and --parts {part.rstrip('0123456789')})")
    spec = ModelSpec.from_config({**SCENARIOS, **DRY_SCENARIOS}[report["shape"]].engine_config())
    prices = kind_prices(spec, prof, PART_TOKENS[part], ctx)
    steps = statistics.median(sum(n for k, (n, _ms) in r.items() if k.endswith("/head")) for r in rounds)
    rows = []
    for kind in sorted({k for r in rounds for k in r}):
        seen = [r[kind] for r in rounds if kind in r]
        n = statistics.median(c for c, _ in seen)
        ms = statistics.median(m for _, m in seen)
        place = kind.split("/", 1)[0]
        # (groups counted fewer times than their routers ran in the steps mostly whole: the prompt's step
        # may take the general path, the decode steps the whole layer)
        whole = kind.endswith("/router") and statistics.median(
            r.get(f"{place}/experts", (0, 0))[0] for r in rounds) < n
        price = prices.get(f"{place}/router+experts" if whole else kind)
        rows.append({"kind": kind, "per_step": n / max(steps, 1), "measured_ms": ms, "priced_ms": price,
                     "ratio": ms / price if price else None,
                     "measured_step_ms": ms * n / max(steps, 1),
                     "priced_step_ms": price * n / max(steps, 1) if price is not None else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.price_check", description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="a share_ab.json written with --host-times")
    ap.add_argument("--profile-file", required=True, help="the profile database the engine planned from")
    ap.add_argument("--part", default="decode", choices=tuple(PART_TOKENS))
    ap.add_argument("--ctx", type=int, default=96, help="context tokens to price attention at (the suite's "
                    "decode runs from 64 to 96)")
    args = ap.parse_args(argv)
    from engine.commands.plan import profile_from_file

    report = json.loads(args.report.read_text())
    rows = compare(report, args.part, profile_from_file(args.profile_file), args.ctx)
    print(f"{report['shape']} at {report['budget']}, {args.part}: host ms per sub-layer, measured (median of "
          f"{len(report['rounds'])} rounds) against the estimator's price")
    print("| kind | per step | measured ms | priced ms | measured / priced | measured ms a step | priced ms a step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        priced = "-" if r["priced_ms"] is None else f"{r['priced_ms']:.3f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        step = "-" if r["priced_step_ms"] is None else f"{r['priced_step_ms']:.1f}"
        print(f"| {r['kind']} | {r['per_step']:.1f} | {r['measured_ms']:.3f} | {priced} | {ratio} | "
              f"{r['measured_step_ms']:.1f} | {step} |")
    tot_m = sum(r["measured_step_ms"] for r in rows)
    tot_p = sum(r["priced_step_ms"] or 0.0 for r in rows)
    print(f"| all | | | | {tot_m / tot_p if tot_p else float('nan'):.2f} | {tot_m:.1f} | {tot_p:.1f} |")
    if any(r["per_step"] < 1 for r in rows):
        print(f"(kinds under one a step ran in other steps, such as the prompt's, and are priced here at "
              f"{PART_TOKENS[args.part]} token(s) all the same)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
