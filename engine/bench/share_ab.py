"""The streamed FFNs' CPU share (`Plan.ffn_cpu_rows`) on and off, in one engine, rounds taking turns.

    python -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants on,off --rounds 3 --out DIR
    python -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants 0,1792,3584 --parts decode

Each variant is `TorchEngine.ffn_share`'s setting: `on` (the planner's shares, the default), `off` (whole
FFNs), or a number of rows forced into every plan that streams a dense FFN (the planner's placements kept:
a share the planner did not choose, set beside its choice). The engine is set up as the suite's
(`slipstream_runs`: the prompts of 512 and 4096 tokens warm first); per round and variant, after one short
untimed request under the new plans: the prompts' prefill rates (`--parts prefill`), one decode run of 32
sampled tokens (`decode`) and 4 and 16 streams decoding together (`batch`, the suite's aggregate rate). The
tokens are the same under every variant (the plans change speed only). Prints a table of medians and writes
share_ab.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import zlib
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.units import parse_bytes

PARTS = ("prefill", "decode", "batch")


def parse_variant(text: str) -> bool | int:
    if text in ("on", "off"):
        return text == "on"
    rows = int(text)
    if rows < 0:
        raise ValueError(text)
    return rows


def plan_shares(eng) -> dict[int, int]:
    """tier -> the CPU rows of its plan's streamed FFNs."""
    return {p.tier: p.ffn_cpu_rows for p in eng.planset.plans}


def measure(eng, parts: tuple[str, ...], r: int, salt: str) -> dict:
    from engine.bench.batch_throughput import run_streams
    from engine.bench.scenarios import PROMPTS
    from engine.bench.slipstream_runs import BATCH_NEW_TOKENS, DECODE_PROMPT, decode_tps, prefill_tps

    out: dict = {}
    if "prefill" in parts:
        for n in PROMPTS:
            out[f"prefill{n}_tps"] = prefill_tps(eng, n, 100 + r, salt)
    if "decode" in parts:
        detail: list[dict] = []
        out["decode_tps"] = decode_tps(eng, 200 + r, salt=salt, detail=detail)
        out["decode_median_ms"] = detail[0]["median_ms"]
    if "batch" in parts and hasattr(eng, "submit"):
        for b in (4, 16):
            res = run_streams(eng, b, DECODE_PROMPT, BATCH_NEW_TOKENS, seed=zlib.crc32(f"{salt}:{r}:{b}".encode()) & 0xFFFF)
            out[f"batch{b}_tps"] = res["decode_aggregate_tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.share_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run)")
    ap.add_argument("--variants", default="on,off",
                    help="comma-separated: on, off, or a number of rows (TorchEngine.ffn_share)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants.split(",") if v]
    except ValueError:
        ap.error(f"--variants {args.variants}: expected on, off or numbers of rows, comma-separated")
    parts = tuple(p for p in args.parts.split(",") if p)
    if not variants or not parts or any(p not in PARTS for p in parts):
        ap.error(f"--parts {args.parts}: expected some of {', '.join(PARTS)}")

    from engine.bench.scenarios import DRY_SCENARIOS, PROMPTS, SCENARIOS
    from engine.bench.slipstream_runs import _empty_cache, open_engine, prefill_tps

    budget = parse_bytes(args.budget)
    eng = open_engine({**SCENARIOS, **DRY_SCENARIOS}[args.shape], budget, args.device, max(PROMPTS) + 256)
    eng.set_vram_budget(budget)
    _empty_cache()
    salt = f"s{budget}"
    for n in PROMPTS:                                   # the suite's warm-up
        prefill_tps(eng, n, 25, salt)
    rounds = []
    for r in range(args.rounds):
        for v in variants:
            eng.ffn_share(v)
            prefill_tps(eng, 16, 400 + r, salt)         # (the switch's weight moves out of the timed work)
            # (each variant its own prompts: the prefix cache must not serve one variant's prompt to the next)
            row = {"round": r, "variant": str(v).lower() if isinstance(v, bool) else v,
                   "shares": plan_shares(eng), **measure(eng, parts, r, f"{salt}:{v}")}
            rounds.append(row)
            print(row, flush=True)
    eng.close()

    keys = [k for k in rounds[0] if k.endswith("_tps") or k.endswith("_ms")]
    table = []
    for v in variants:
        name = str(v).lower() if isinstance(v, bool) else v
        mine = [row for row in rounds if row["variant"] == name]
        table.append({"variant": name, "shares": mine[0]["shares"],
                      **{k: round(statistics.median(row[k] for row in mine if row.get(k) is not None), 2)
                         for k in keys if any(row.get(k) is not None for row in mine)}})
    print(f"\n{args.shape} at {args.budget}, {args.rounds} rounds taking turns (medians):")
    print("| variant | " + " | ".join(keys) + " | CPU rows by tier |")
    print("|---" * (len(keys) + 2) + "|")
    for t in table:
        shares = ", ".join(f"{k}:{v}" for k, v in t["shares"].items() if v) or "none"
        print(f"| {t['variant']} | " + " | ".join(str(t.get(k, "-")) for k in keys) + f" | {shares} |")
    write_report(args.out, "share_ab", {"shape": args.shape, "budget": args.budget, "device": args.device,
                                              "variants": [str(v) for v in variants], "parts": list(parts),
                                              "rounds": rounds, "medians": table},
                 "python -m engine.bench.share_ab " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
