"""The decode tier through one streaming slot against two, as the planner prices them from a profile database
(no GPU needed): per shape and budget, the one-token plan's predicted step (and its steps of 4, 8 and 16 tokens:
verify steps and small batches run on it), slots and resident weights with
`Planner()` (two slots, the default) and with `one_slot_tiers=planner.ONE_SLOT_TIERS`, and how long the
planning took on this machine. `--transfer-ratio R` prices streams transfer-coded to R of their bytes (the
engine's attention, FFN and head sub-layers, as `TorchEngine` codes them; its weights coded 0.7529 on the H200).

    python -m engine.bench.one_slot_plans --profile-file docs/benchmarks/profiles/h200.json --out DIR

Prints a table; writes DIR/one_slot_plans.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def coded_like(spec, ratio: float):
    """`spec` with its attention, FFN and head sub-layers transfer-coded to `ratio` of their bytes, and the
    staging buffer of a 64 MiB chunk at that ratio (`TorchEngine` codes what it may stream)."""
    from engine.sharding.memory import sublayer_bytes
    from engine.sharding.transfer_code import CHUNK_WORDS

    sizes = dict(sublayer_bytes(spec))
    coded = {s.name: int(sizes[s.name] * ratio) for s in spec.sublayers if s.kind in ("attn", "ffn", "head")}
    return spec.with_transfer(coded, int(2 * CHUNK_WORDS * ratio) + 4096)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile-file", type=Path, required=True)
    ap.add_argument("--shapes", default="llama3-8b,qwen3-30b-a3b")
    ap.add_argument("--budgets", default="2GiB,4GiB,8GiB")
    ap.add_argument("--kv-tokens", type=int, default=4096)
    ap.add_argument("--transfer-ratio", type=float, default=None,
                    help="price streams transfer-coded to this share of their bytes (default: raw)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from engine.bench.gpu_common import write_report
    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.planner import ONE_SLOT_TIERS, Planner, planning_context
    from engine.sharding.spec import ModelSpec
    from engine.units import format_bytes, parse_bytes

    prof = profile_from_file(a.profile_file)
    Planner(ModelSpec.from_config(get_shape("smollm2-135m")), prof).plan(1 << 30)   # (imports, first calls)
    rows = []
    print("| shape | budget | slots allowed | tier-1 ms | its 4 / 8 / 16-token steps ms | slots | resident weights | "
          "tier-16 plan ms | planning s |\n|---|---|---|---:|---|---:|---|---:|---:|")
    for shape in a.shapes.split(","):
        spec = ModelSpec.from_config(get_shape(shape))
        if a.transfer_ratio:
            spec = coded_like(spec, a.transfer_ratio)
        for allowed, one_slot in (("two", ()), ("one or two", ONE_SLOT_TIERS)):
            planner = Planner(spec, prof, one_slot_tiers=one_slot)
            for budget in a.budgets.split(","):
                t0 = time.perf_counter()
                ps = planner.plan(parse_bytes(budget), kv_tokens=a.kv_tokens)
                took = time.perf_counter() - t0          # (the first budget of each prices the tables)
                one, sixteen = ps.for_tokens(1), ps.for_tokens(16)
                small = [round(planner.estimate(one, n, planning_context(n, a.kv_tokens)), 2) for n in (4, 8, 16)]
                rows.append({"shape": shape, "budget": budget, "slots_allowed": allowed,
                             "tier1_ms": round(one.predicted_ms, 2), "tier1_slots": one.n_slots,
                             "tier1_weights": one.vram.weights, "tier1_plan_at_4_8_16_ms": small, "tier16_ms": round(sixteen.predicted_ms, 2),
                             "tier16_slots": sixteen.n_slots, "planning_s": round(took, 2)})
                print(f"| {shape} | {budget} | {allowed} | {one.predicted_ms:.1f} | {' / '.join(map(str, small))} | "
                      f"{one.n_slots} | "
                      f"{format_bytes(one.vram.weights)} | {sixteen.predicted_ms:.1f} | {took:.2f} |", flush=True)
    path = write_report(a.out, "one_slot_plans", {"profile": str(a.profile_file), "kv_tokens": a.kv_tokens,
                                                   "transfer_ratio": a.transfer_ratio, "rows": rows},
                        "python -m engine.bench.one_slot_plans " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
