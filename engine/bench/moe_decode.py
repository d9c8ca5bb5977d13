"""Slipstream's mixture-of-experts decode on its own: tokens/s at given VRAM budgets, with the plan chosen.

    python -m engine.bench.moe_decode --device cuda --budgets 4GiB,8GiB        # Qwen3-30B-A3B, 24 layers
    python -m engine.bench.moe_decode --device sim --model tiny-moe --budgets 3MiB --kinds gpu_only \
        --tiers 1,4 --out /tmp/x                                                # any machine

One engine over random weights (bf16; the scenario's shape: qwen3-30b-a3b is 24 of its 48 layers), budgets
applied live in ascending order. Per budget and plan kind (`--kinds`; "auto" is the planner's choice): a
warm-up, then a greedy decode of `--tokens` tokens after a 64-token prompt; tokens/s over the decode steps
after the first few, weight bytes copied per decode step, routed expert loads per step, the engine's
booked VRAM peak and the decode tier's plan (kind, predicted ms, where the expert groups sit). Where the
decode plan streams expert groups, the same plan runs again with whole-group streaming (`routed: false`),
the baseline routed streaming is measured against. Writes a table and docs/benchmarks/gpu/moe_decode.json
(command, machine, date).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.bench.scenarios import DRY_SCENARIOS, SCENARIOS
from engine.bench.slipstream_runs import compact_plan, open_engine, placements_by_kind
from engine.units import format_bytes, parse_bytes

PROMPT = "".join(chr(33 + (i * 37) % 94) for i in range(64))   # varied bytes: routing spreads as for text
SKIP = 3            # decode steps left out of the rate (first-step and warm-up effects)


def decode_plan(report: dict) -> dict:
    """The decode tier's plan: kind, predicted ms and where routers and expert groups sit."""
    t = report["tiers"][0]
    where = placements_by_kind(t["placement"])
    return {"tokens": t["tokens"], "plan": t["plan"], "predicted_ms": t["predicted_ms"],
            "predicted_tps": 1e3 * t["tokens"] / t["predicted_ms"] if t["predicted_ms"] else None,
            "vram": t["vram"], "placements": where}


def measure(eng, n_tokens: int) -> dict:
    ex = eng.executor
    list(eng.generate(PROMPT, max_new_tokens=4))                       # warm-up
    stamps, marks = [], []
    for ev in eng.generate(PROMPT, max_new_tokens=n_tokens):
        if ev.token_id is not None:
            stamps.append(time.perf_counter())
            marks.append((ex.copied_bytes, ex.routed_loads))
    if len(stamps) <= SKIP + 1:
        raise SystemExit(f"--tokens {n_tokens}: too few decode steps to time (need more than {SKIP + 1})")
    steps = len(stamps) - 1 - SKIP
    (b0, r0), (b1, r1) = marks[SKIP], marks[-1]
    return {"decode_tps": steps / (stamps[-1] - stamps[SKIP]), "decode_steps": steps,
            "copied_bytes_per_step": (b1 - b0) / steps, "routed_loads_per_step": (r1 - r0) / steps}


def streams_experts(plan: dict) -> bool:
    return plan["placements"].get("experts", {}).get("streamed", 0) > 0


def run(args, save=None) -> dict:
    """Every row measured; `save(partial_result)` after each row, so a run cut short keeps its rows."""
    table = DRY_SCENARIOS if args.device == "sim" and args.model in DRY_SCENARIOS else SCENARIOS
    if args.model not in table or table[args.model].kind != "moe":
        known = [n for n, s in {**SCENARIOS, **DRY_SCENARIOS}.items() if s.kind == "moe"]
        raise SystemExit(f"--model {args.model!r}: expected a MoE scenario ({', '.join(known)})")
    scenario = table[args.model]
    budgets = sorted(((b, parse_bytes(b)) for b in args.budgets.split(",")), key=lambda x: x[1])
    kinds = args.kinds.split(",")
    t0 = time.perf_counter()
    extra = {"tiers": tuple(int(t) for t in args.tiers.split(","))} if args.tiers else {}
    eng = open_engine(scenario, budgets[0][1], args.device, n_ctx=args.ctx, **extra)
    open_s = time.perf_counter() - t0
    print(f"{scenario.model}: opened in {open_s:.0f} s ({scenario.note or 'full shape'})", flush=True)
    rows = []
    try:
        for bname, b in budgets:
            eng.set_vram_budget(b)
            for kind in kinds:
                eng.force_plan(kind)
                plan = decode_plan(eng.plan_report())
                modes = [None, False] if streams_experts(plan) and not args.no_whole else [None]
                for routed in modes:
                    eng.executor.routed_experts = routed
                    t1 = time.perf_counter()
                    m = measure(eng, args.tokens)
                    row = {"budget": bname, "budget_bytes": b, "kind": kind, "routed": routed is None, **m,
                           "engine_peak_bytes": eng.accel.peak if eng.accel is not None else 0,
                           "seconds": round(time.perf_counter() - t1, 1), "decode_plan": plan,
                           "plan": compact_plan(eng.plan_report())}
                    rows.append(row)
                    if save is not None:
                        save({"model": scenario.model, "note": scenario.note, "device": args.device,
                              "tokens": args.tokens, "open_seconds": round(open_s, 1), "rows": rows,
                              "partial": True})
                    print(f"  {bname} {kind}{'' if routed is None else ' (whole groups)'}: "
                          f"{m['decode_tps']:.2f} tok/s (predicted {plan['predicted_tps'] or 0:.2f}), "
                          f"{format_bytes(int(m['copied_bytes_per_step']))} copied/step, plan {plan['plan']}, "
                          f"experts {plan['placements'].get('experts')}", flush=True)
            eng.executor.routed_experts = None
    finally:
        eng.close()
    return {"model": scenario.model, "note": scenario.note, "device": args.device, "tokens": args.tokens,
            "open_seconds": round(open_s, 1), "rows": rows}


def print_table(result: dict) -> None:
    print("| budget | kind | streaming | decode tok/s | predicted tok/s | copied / step | decode plan |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        p = r["decode_plan"]
        print(f"| {r['budget']} | {r['kind']} | {'routed' if r['routed'] else 'whole groups'} | "
              f"{r['decode_tps']:.2f} | {p['predicted_tps'] or 0:.2f} | "
              f"{format_bytes(int(r['copied_bytes_per_step']))} | {p['plan']} {p['placements'].get('experts')} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda, or sim (the CPU standing in for a GPU)")
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a MoE scenario (tiny-moe with --device sim)")
    ap.add_argument("--budgets", default="4GiB,8GiB")
    ap.add_argument("--kinds", default="auto", help="plan kinds, comma-separated: auto,static,dynamic,gpu_only")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1024, help="context (KV capacity) the engine plans for")
    ap.add_argument("--tiers", default=None, help="token tiers to plan, e.g. 1,4,64 (default: the engine's)")
    ap.add_argument("--no-whole", action="store_true", help="skip the whole-group streaming baseline")
    ap.add_argument("--out", default="docs/benchmarks/gpu")
    args = ap.parse_args(argv)
    command = " ".join(["python -m engine.bench.moe_decode"] + (argv if argv is not None else sys.argv[1:]))
    result = run(args, save=lambda partial: write_report(Path(args.out), "moe_decode", partial, command))
    print_table(result)
    path = write_report(Path(args.out), "moe_decode", result, command)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
