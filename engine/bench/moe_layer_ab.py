"""Decode with and without the CPU layer calls (`--calls`: the MoE layer call `moe.layer_cpu`, the one-token
attention call `kernels.attention_decode`, with the dense FFN call `kernels.ffn_layer`, or all), alternating
in one engine, at each budget: tokens/s per run, and whether greedy decoding gave the same tokens both ways.

    python -m engine.bench.moe_layer_ab --layers 24 --budgets 4GiB,2GiB,8GiB --out DIR   # the GPU machine
    python -m engine.bench.moe_layer_ab --layers 2 --device sim --budgets 8GiB --out DIR  # a dry run
    python -m engine.bench.moe_layer_ab --shape llama3-8b --layers 0 --calls dense --budgets 4GiB --out DIR
    ... --n-ctx suite --long-prompt 4096    the suite's context, and its longest prompt first at each budget
                                            (the cached prompt's KV counts in the plans, as in the suite)

The Qwen3-30B-A3B shape (`--shape`) at full width with `--layers` layers (random bf16 weights, `random_std`), one
engine whose budget moves with `set_vram_budget`, as the suite runs it. Per budget: one warm-up each way,
then `--reps` rounds of (on, off) in turn, each a fresh prompt of `--prompt` random printable bytes and
`--tokens` sampled tokens (temperature 1, a seed per round, as the suite's decode rows); decode tokens/s
counts from the first token to the last. Then one greedy decode each way from the same prompt, to
compare the tokens; with `--batches`, batches of that many streams submitted at once (the suite's batch
rows' aggregate rate), twice each way. Alternating inside one process keeps leases' and processes' drift out of the
comparison (session 10 measured up to 1.5x between processes of one lease on this shape). Writes a table
and moe_layer_ab[_<tag>].json (command, machine, date).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import open_shape, write_report
from engine.bench.slipstream_runs import compact_plan, suite_n_ctx
from engine.units import parse_bytes


def decode_tps(eng, prompt: str, n: int, temperature: float, seed: int) -> tuple[float, list[int]]:
    """Tokens/s from the first new token to the last, and the tokens."""
    stamps, tokens = [], []
    for ev in eng.generate(prompt, max_new_tokens=n, temperature=temperature, seed=seed):
        if ev.token_id is None:
            continue
        stamps.append(time.perf_counter())
        tokens.append(ev.token_id)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0, tokens


CALLS = {"moe": ("cpu_moe_layer",), "attention": ("cpu_attention_call",), "dense": ("cpu_attention_call", "ffn"),
         "all": ("cpu_moe_layer", "cpu_attention_call", "ffn")}


def _set(ex, on: bool, calls: str) -> None:
    """Turn the switches of the calls under test (`--calls`) on or off; the others stay on. "ffn": the
    one-call dense FFN (`kernels.set_ffn_call`, process-wide); the rest: the executor's."""
    from engine import kernels

    for name in CALLS[calls]:
        if name == "ffn":
            kernels.set_ffn_call(on)
        else:
            setattr(ex, name, on)


def batch_rates(eng, batches: list[int], tokens: int, calls: str = "moe") -> dict:
    """Aggregate decode tokens/s of `b` streams submitted at once (as the suite's batch rows), on then off
    for each b, then off then on (two runs each way)."""
    from engine.bench.batch_throughput import run_streams

    ex, out = eng.executor, {}
    for b in batches:
        runs = {True: [], False: []}
        for flag in (True, False, False, True):
            _set(ex, flag, calls)
            runs[flag].append(round(run_streams(eng, b, 64, tokens, seed=b)["decode_aggregate_tokens_per_s"], 2))
        out[str(b)] = {"on_tps": runs[True], "off_tps": runs[False],
                       "speedup": round(statistics.median(runs[True]) / statistics.median(runs[False]), 3)}
    _set(ex, True, calls)
    return out


def run_budget(eng, budget: str, reps: int, tokens: int, prompt_len: int, rng: random.Random,
               calls: str = "moe", long_prompt: int = 0) -> dict:
    eng.set_vram_budget(parse_bytes(budget))
    ex = eng.executor
    row = {"budget": budget, "on_tps": [], "off_tps": []}

    def prompt(n: int = prompt_len) -> str:
        return "".join(chr(rng.randint(33, 126)) for _ in range(n))

    if long_prompt:     # as the suite, whose prompts' blocks stay in the prefix cache and count in the plan
        decode_tps(eng, prompt(long_prompt), 1, 1.0, 0)
    for flag in (True, False):                        # warm-up, both ways
        _set(ex, flag, calls)
        decode_tps(eng, prompt(), 8, 1.0, 0)
    tier1 = next((t for t in compact_plan(eng.plan_report())["tiers"] if t.get("tokens") == 1), {})
    row["decode_plan"] = {k: tier1.get(k) for k in ("plan", "predicted_ms", "by_kind")}
    for r in range(reps):
        for flag in ((True, False) if r % 2 == 0 else (False, True)):
            _set(ex, flag, calls)
            tps, _ = decode_tps(eng, prompt(), tokens, 1.0, r + 1)
            row["on_tps" if flag else "off_tps"].append(round(tps, 2))
    same = prompt()
    greedy = {}
    for flag in (True, False):
        _set(ex, flag, calls)
        ex.kv.forget_cached()        # (else the second run reuses the first's prompt blocks: other steps, other bits)
        greedy[flag] = decode_tps(eng, same, tokens, 0.0, 0)[1]
    _set(ex, True, calls)
    row["plan_refines"], row["plan_refine_s"] = eng.refines["count"], round(eng.refines["seconds"], 2)
    row["on_median_tps"] = statistics.median(row["on_tps"])
    row["off_median_tps"] = statistics.median(row["off_tps"])
    row["speedup"] = round(row["on_median_tps"] / row["off_median_tps"], 3) if row["off_median_tps"] else None
    row["greedy_same_tokens"] = greedy[True] == greedy[False]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.moe_layer_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a shape of engine.bench.shapes (or tiny-moe, tiny-llama)")
    ap.add_argument("--layers", type=int, default=24, help="keep this many layers (0: all)")
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run)")
    ap.add_argument("--budgets", default="4GiB,2GiB,8GiB")
    ap.add_argument("--reps", type=int, default=3, help="rounds of (on, off) per budget")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64, help="prompt length in random printable bytes")
    ap.add_argument("--batches", default="", help="also batches of these many streams, on and off (e.g. 4,16)")
    ap.add_argument("--calls", choices=tuple(CALLS), default="moe",
                    help="which CPU calls to turn on and off: the MoE layer call, the one-token attention call, "
                         "attention and dense FFN, all three")
    ap.add_argument("--n-ctx", default="", help="the engine's context length (default: the engine's own; "
                    "'suite': the suite's, whose KV reservation changes the plans at a budget)")
    ap.add_argument("--long-prompt", type=int, default=0,
                    help="first, at each budget, one prompt of this many bytes (the suite's 4096: its KV stays "
                         "cached and the plans count it)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)
    budgets = [b for b in args.budgets.split(",") if b]
    t0 = time.perf_counter()
    n_ctx = suite_n_ctx() if args.n_ctx == "suite" else (int(args.n_ctx) if args.n_ctx else None)
    eng = open_shape(args.shape, parse_bytes(budgets[0]), device=args.device, layers=args.layers, n_ctx=n_ctx)
    opened = time.perf_counter() - t0
    rng = random.Random(0)
    rows = []
    try:
        for b in budgets:
            rows.append(run_budget(eng, b, args.reps, args.tokens, args.prompt, rng, args.calls, args.long_prompt))
            r = rows[-1]
            if args.batches:
                r["batches"] = batch_rates(eng, [int(n) for n in args.batches.split(",")], args.tokens, args.calls)
                print(f"{b} batches: " + "; ".join(f"{n}: on {v['on_tps']} off {v['off_tps']} -> {v['speedup']}x"
                                                  for n, v in r["batches"].items()), flush=True)
            print(f"{b}: on {r['on_tps']} off {r['off_tps']} -> {r['speedup']}x, greedy same: "
                  f"{r['greedy_same_tokens']}; plan {r['decode_plan'].get('predicted_ms') or 0:.1f} ms "
                  f"predicted; plan tables priced in the background so far: {r['plan_refines']} "
                  f"({r['plan_refine_s']} s)", flush=True)
    finally:
        eng.close()
    print("\n| budget | layer call on (t/s) | off (t/s) | on / off | greedy tokens equal | decode plan predicted ms |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['budget']} | {r['on_median_tps']:.2f} | {r['off_median_tps']:.2f} | {r['speedup']} | "
              f"{r['greedy_same_tokens']} | {r['decode_plan'].get('predicted_ms') or 0:.1f} |")
    name = "moe_layer_ab" + (f"_{args.tag}" if args.tag else "")
    path = write_report(args.out, name, {"device": args.device, "shape": args.shape, "calls": args.calls,
                                         "layers": args.layers, "n_ctx": eng.context_length,
                                         "long_prompt": args.long_prompt, "open_seconds": round(opened, 1),
                                         "reps": args.reps, "tokens": args.tokens, "rows": rows},
                        "python -m engine.bench.moe_layer_ab " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
