"""Decode as the suite runs it, token by token: each token's wall time in `generate` beside the
estimator's prediction for the plan it ran, and traces of a few early and a few late steps (a range
per sub-layer; per-kind times as `engine.bench.trace_breakdown` prints them). For a suite row that is far slower than its plan's prediction.

    python -m engine.bench.decode_steps --shape llama3-8b --budgets 2GiB,4GiB --out DIR
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report
from engine.bench.scenarios import DRY_SCENARIOS, PROMPTS, SCENARIOS
from engine.units import parse_bytes


def token_times(eng, prompt: str, n: int) -> list[float]:
    """Seconds between consecutive yielded tokens (the first entry is time to the first token)."""
    out, last = [], time.perf_counter()
    for ev in eng.generate(prompt, max_new_tokens=n, temperature=1.0, seed=len(prompt)):   # (as the suite)
        if ev.token_id is None:            # the final event carries no token
            continue
        now = time.perf_counter()
        out.append(now - last)
        last = now
    return out


def _profiler() -> torch.profiler.profile:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def _report(prof, path: Path, title: str) -> dict:
    """Write the gzipped chrome trace to `path`; print and return the per-kind breakdown."""
    from engine.bench.trace_breakdown import breakdown, print_report

    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    raw.unlink()
    r = breakdown(events)
    print(f"-- {title}:", flush=True)
    print_report(r, 6)
    return {"kinds": {k: {"n": v["n"], "mean_ms": v["us"] / v["n"] / 1e3,
                          "outside_ms": v["outside_us"] / v["n"] / 1e3} for k, v in r["kinds"].items()},
            "busy": r["busy"], "trace": path.name}


def traced_steps(eng, prompt: str, skip: int, steps: int, path: Path) -> dict:
    """Profile decode tokens skip+1 .. skip+steps of one generation (a range per sub-layer), write the
    gzipped chrome trace to `path`, print and return the per-kind breakdown."""
    prof = _profiler()
    eng.executor.label_sublayers = True
    try:
        for i, _ in enumerate(eng.generate(prompt, max_new_tokens=skip + steps + 1)):
            if i == skip:
                prof.start()
            elif i == skip + steps:
                prof.stop()
    finally:
        eng.executor.label_sublayers = False
    return _report(prof, path, f"decode tokens {skip + 1}..{skip + steps}")


def traced_prefill(eng, n: int, run: int, path: Path) -> dict:
    """Profile one prefill of an `n`-token prompt (no cached prefix), as `traced_steps` does a decode."""
    from engine.bench.slipstream_runs import _prompt

    eng.executor.label_sublayers = True
    try:
        with _profiler() as prof:
            t = time.perf_counter()
            for _ in eng.generate(_prompt(n, run), max_new_tokens=1):
                pass
            wall = time.perf_counter() - t
    finally:
        eng.executor.label_sublayers = False
    return {"tokens": n, "traced_ms": wall * 1e3,
            **_report(prof, path, f"prefill of {n} tokens (traced: {wall * 1e3:.0f} ms)")}


def _rss_gib() -> float:
    try:
        import psutil
        return psutil.Process(os.getpid()).memory_info().rss / 2**30
    except ImportError:
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budgets", default="2GiB,4GiB")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--late-token", type=int, default=40, help="the late traced steps start after this token")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run on this machine)")
    ap.add_argument("--prefill-trace", type=int, default=0, help="also trace one prefill of this many tokens")
    ap.add_argument("--no-decode-traces", action="store_true", help="time the decode, trace none of it")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from engine.bench.slipstream_runs import DECODE_PROMPT, _empty_cache, _prompt, open_engine, prefill_tps

    budgets = [(b, parse_bytes(b)) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    eng = open_engine({**SCENARIOS, **DRY_SCENARIOS}[args.shape], budgets[0][1], args.device, max(PROMPTS) + 256)
    print(f"opened in {time.perf_counter() - t0:.0f} s; process RSS {_rss_gib():.1f} GiB", flush=True)
    rows = []
    for name, b in budgets:
        eng.set_vram_budget(b)
        _empty_cache()
        for n in PROMPTS:
            prefill_tps(eng, n, 25)
        token_times(eng, _prompt(DECODE_PROMPT, 24), 4)
        times = token_times(eng, _prompt(DECODE_PROMPT, 3), args.tokens)
        rep = eng.plan_report()
        tier1 = rep["tiers"][0]
        steady = times[1:]
        row = {"budget": name, "ttft_ms": times[0] * 1e3, "token_ms": [round(t * 1e3, 2) for t in steady],
               "median_ms": statistics.median(steady) * 1e3, "mean_ms": statistics.fmean(steady) * 1e3,
               "predicted_ms": tier1["predicted_ms"], "plan": tier1["plan"],
               "engine_decode_tps": eng.stats()["decode_tokens_per_s"]}
        print(f"== {name}: tier-1 plan {tier1['plan']} predicted {tier1['predicted_ms']:.1f} ms; measured median "
              f"{row['median_ms']:.1f} mean {row['mean_ms']:.1f} ms; first 6 {row['token_ms'][:6]}; last 4 "
              f"{row['token_ms'][-4:]}; engine {row['engine_decode_tps']:.2f} tok/s", flush=True)
        for when, skip in () if args.no_decode_traces else (("early", 1), ("late", args.late_token)):
            path = args.out / f"decode_steps_{name}_{when}.json.gz"
            row[f"trace_{when}"] = traced_steps(eng, _prompt(DECODE_PROMPT, 5), skip, args.profile_steps, path)
        if args.prefill_trace:
            row["prefill_trace"] = traced_prefill(eng, args.prefill_trace, 6,
                                                  args.out / f"prefill_{args.prefill_trace}_{name}.json.gz")
        rows.append(row)
    write_report(args.out, "decode_steps", {"shape": args.shape, "rows": rows},
                 "python -m engine.bench.decode_steps " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
