"""The streamed FFNs' CPU share (`Plan.ffn_cpu_rows`) on and off, in one engine, rounds taking turns.

    python -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants on,off --rounds 3 --out DIR
    python -m engine.bench.share_ab --shape llama3-8b --budget 4GiB --variants 0,1792,3584 --parts decode

Every other round takes the variants in reverse order. Each variant is `TorchEngine.ffn_share`'s setting: `on` (the planner's shares, the default), `off` (whole
FFNs), or a number of rows forced into every plan that streams a dense FFN (the planner's placements kept:
a share the planner did not choose, set beside its choice). The engine is set up as the suite's
(`slipstream_runs`: the prompts of 512 and 4096 tokens warm first); per round and variant, after one short
untimed request under the new plans: the prompts' prefill rates (`--parts prefill`), one decode run of 32
sampled tokens (`decode`) and 4 and 16 streams decoding together (`batch`, the suite's aggregate rate). The
tokens are the same under every variant (the plans change speed only). Prints a table of medians and writes
share_ab.json. With `--moves`, the variants are placements instead (`TorchEngine.move_to_cpu` entries, as in
`decode_runs --cpu-variants`); `--host-times` times the batches' sub-layers too, and `--phases` the native
layer calls phase by phase (beside the sub-layer timer's wall time per kind: what happens outside the calls).
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


def _host_ms(times: dict) -> dict:
    """The executor's sub-layer timer as placement/kind -> [count, mean host ms]."""
    return {k: [n, round(sec / max(n, 1) * 1e3, 3)] for k, (n, sec) in sorted(times.items())}


def _phases_per_call(ph: dict | None) -> dict | None:
    """`kernels.read_phases()` as ms per call of each phase (None where the native library is not loaded)."""
    if ph is None:
        return None
    out = {}
    for kind in ("attention", "ffn"):
        n = ph[f"{kind}_calls"]
        out[kind] = {"calls": n, **{p: round(sec * 1e3 / n, 4) for p, sec in ph[kind].items()}} if n else {"calls": 0}
    return out


def measure(eng, parts: tuple[str, ...], r: int, salt: str, host_times: bool = False, phases: bool = False) -> dict:
    from engine import kernels
    from engine.bench.batch_throughput import run_streams
    from engine.bench.scenarios import PROMPTS
    from engine.bench.slipstream_runs import BATCH_NEW_TOKENS, DECODE_PROMPT, decode_tps, prefill_tps

    out: dict = {}
    if "prefill" in parts:
        for n in PROMPTS:
            out[f"prefill{n}_tps"] = prefill_tps(eng, n, 100 + r, salt)
    if "decode" in parts:
        detail: list[dict] = []
        ex = eng.executor
        ex.sublayer_times = {} if host_times else None
        if phases:
            kernels.read_phases()                           # (resets the sums)
        out["decode_tps"] = decode_tps(eng, 200 + r, salt=salt, detail=detail)
        if phases:
            out["decode_phases"] = _phases_per_call(kernels.read_phases())
        out["decode_median_ms"] = detail[0]["median_ms"]
        if host_times:     # per placement/kind: count and mean host ms (the prompt's step included)
            out["host_ms"] = _host_ms(ex.sublayer_times)
        ex.sublayer_times = None
    if "batch" in parts and hasattr(eng, "submit"):
        ex = eng.executor
        for b in (4, 16):
            ex.sublayer_times = {} if host_times else None
            if phases:
                kernels.read_phases()
            res = run_streams(eng, b, DECODE_PROMPT, BATCH_NEW_TOKENS, seed=zlib.crc32(f"{salt}:{r}:{b}".encode()) & 0xFFFF)
            if phases:
                out[f"batch{b}_phases"] = _phases_per_call(kernels.read_phases())
            out[f"batch{b}_tps"] = res["decode_aggregate_tokens_per_s"]
            if host_times:   # (the prompts' steps included)
                out[f"batch{b}_host_ms"] = _host_ms(ex.sublayer_times)
            ex.sublayer_times = None
    return out


def time_cpu_part(eng, rows: int, reps: int = 20) -> dict:
    """The host's share of one dense FFN alone: `dense.ffn_hidden` over its last `rows` rows of gate and up,
    for one token, from the host copy (ms per call and the weight bytes' rate)."""
    import time

    import torch

    from engine.models import dense

    cfg = eng.config
    name = next(f"layers.{i}.ffn" for i in range(cfg.num_layers) if f"layers.{i}.ffn" in eng.executor._dense_ffn)
    w = eng.executor.store.sublayers[name].host_views
    inter = cfg.intermediate_size
    rows = min(rows, inter)
    x = torch.randn(1, cfg.hidden_size, dtype=w["down.weight"].dtype)
    for _ in range(3):
        dense.ffn_hidden(cfg, w, x, inter - rows, inter)
    t0 = time.perf_counter()
    for _ in range(reps):
        dense.ffn_hidden(cfg, w, x, inter - rows, inter)
    ms = (time.perf_counter() - t0) / reps * 1e3
    nbytes = 2 * rows * cfg.hidden_size * w["down.weight"].element_size()
    gu = w.get("gate_up.weight")
    gate = gu[inter - rows:inter] if gu is not None else w["gate.weight"][inter - rows:]
    from engine import kernels

    return {"rows": rows, "ms": round(ms, 3), "gbps": round(nbytes / ms / 1e6, 1),
            "native": kernels.usable(x, gate), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.share_ab", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run)")
    ap.add_argument("--variants", default="on,off",
                    help="comma-separated: on, off, or a number of rows (TorchEngine.ffn_share)")
    ap.add_argument("--moves", default="",
                    help="instead of shares: ';'-separated placements set beside each other (TorchEngine.move_to_cpu: "
                         "'none', or entries joined by '+', e.g. 'none;layers.[0-3].attn=resident')")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--host-times", action="store_true",
                    help="the decode runs with the executor's sub-layer timer on (host ms per placement/kind)")
    ap.add_argument("--phases", action="store_true",
                    help="time the native attention and FFN layer calls phase by phase over the decode and the "
                         "batches (kernels.set_phase_timing: a clock read between phases)")
    ap.add_argument("--cpu-part-rows", default="",
                    help="comma-separated row counts: before the rounds, time the host's share of one FFN "
                         "alone (dense.ffn_hidden over the last rows of gate and up, one token)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    try:
        variants = [parse_variant(v) for v in args.variants.split(",") if v]
    except ValueError:
        ap.error(f"--variants {args.variants}: expected on, off or numbers of rows, comma-separated")
    moves = [m.strip() for m in args.moves.split(";") if m.strip()]
    if moves:
        variants = moves
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
    cpu_part = [time_cpu_part(eng, int(k)) for k in args.cpu_part_rows.split(",") if k]
    for c in cpu_part:
        print(f"host share alone: {c}", flush=True)
    if args.phases:
        from engine import kernels

        kernels.set_phase_timing(True)
    rounds = []
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):   # (ABBA: a drifting lease favours none)
            if moves:
                eng.move_to_cpu(() if v == "none" else tuple(v.split("+")))
            else:
                eng.ffn_share(v)
            prefill_tps(eng, 16, 400 + r, salt)         # (the switch's weight moves out of the timed work)
            # (each variant its own prompts: the prefix cache must not serve one variant's prompt to the next)
            row = {"round": r, "variant": str(v).lower() if isinstance(v, bool) else v,
                   "shares": plan_shares(eng), **measure(eng, parts, r, f"{salt}:{v}", args.host_times, args.phases)}
            rounds.append(row)
            print(row, flush=True)
    eng.close()
    if args.phases:
        kernels.set_phase_timing(False)

    keys = [k for k in rounds[0] if k.endswith(("_tps", "_ms")) and isinstance(rounds[0][k], int | float)]
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
                                              "rounds": rounds, "medians": table, "cpu_part": cpu_part},
                 "python -m engine.bench.share_ab " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
