"""The decode plan the planner picks, and its predicted step time, by VRAM budget and by the KV capacity it
plans for: what a KV capacity grown by a long prompt costs the decode that follows (and what cutting it back
at a short request gives back, `TorchEngine._fit_kv_to_request`).

    python -m engine.bench.kv_capacity_plans --profile-file docs/benchmarks/profiles/h200.json --out DIR

Planning only (no weights, no GPU): the shapes as the suite runs them (`engine.bench.scenarios`), the whole-
process budgets less the process overhead the suite's engines measured on the H200 (`--overhead`) and the
allocator margin (`device.ALLOCATOR_MARGIN`), the tier-1 plan at each KV capacity. Prints a table and writes
kv_capacity_plans.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.bench.scenarios import SCENARIOS
from engine.bench.shapes import get_shape
from engine.bench.slipstream_runs import placements_by_kind
from engine.commands.plan import profile_from_file
from engine.sharding.device import ALLOCATOR_MARGIN
from engine.sharding.planner import Planner
from engine.sharding.spec import ModelSpec
from engine.units import parse_bytes

GiB = 1 << 30


def bookable(budget: int, overhead: int) -> int:
    """What a whole-process budget leaves for the engine's bookings on CUDA (as `Accelerator.usable`)."""
    return max(0, budget - overhead - max(ALLOCATOR_MARGIN[0], int(budget * ALLOCATOR_MARGIN[1])))


def plans(model: str, prof, budgets: list[str], kv_tokens: list[int], overhead: int) -> list[dict]:
    scenario = SCENARIOS[model]
    cfg = get_shape(scenario.gguf_shape)
    if scenario.layers:
        cfg = dataclasses.replace(cfg, num_layers=scenario.layers)
    planner = Planner(ModelSpec.from_config(cfg, dtype="bfloat16"), prof)
    rows = []
    for name in budgets:
        room = bookable(parse_bytes(name), overhead)
        for kv in kv_tokens:
            plan = planner.plan(room, kv_tokens=kv).for_tokens(1)
            rows.append({"model": model, "budget": name, "bookable_bytes": room, "kv_tokens": kv,
                         "plan": plan.kind, "predicted_ms": round(plan.predicted_ms, 2),
                         "by_kind": placements_by_kind({n: p.value for n, p in plan.placement.items()})})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.kv_capacity_plans", description=__doc__.split("\n")[0])
    ap.add_argument("--profile-file", default="docs/benchmarks/profiles/h200.json")
    ap.add_argument("--models", default="llama3-8b,qwen3-30b-a3b")
    ap.add_argument("--budgets", default="2GiB,4GiB,8GiB")
    ap.add_argument("--kv-tokens", default="2048,4352,8704",
                    help="capacities: the initial one, and what the suite's 4096-token prompts grow it to")
    ap.add_argument("--overhead", default="812MiB",
                    help="the process's VRAM outside its bookings (call NN's suite rows: 786-814 MiB)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    prof = profile_from_file(args.profile_file)
    budgets = [b for b in args.budgets.split(",") if b]
    kvs = [int(k) for k in args.kv_tokens.split(",") if k]
    rows = [r for m in args.models.split(",") if m for r in plans(m, prof, budgets, kvs, parse_bytes(args.overhead))]
    print("| model | budget | KV tokens | plan | predicted ms | t/s | placement |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['budget']} | {r['kv_tokens']} | {r['plan']} | {r['predicted_ms']:.1f} | "
              f"{1e3 / r['predicted_ms']:.2f} | {r['by_kind']} |")
    path = write_report(args.out, "kv_capacity_plans", {"profile_file": args.profile_file, "overhead": args.overhead,
                                                         "rows": rows},
                        "python -m engine.bench.kv_capacity_plans " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
