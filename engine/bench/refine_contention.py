"""Decode beside the thread that prices a new KV capacity's plans (`TorchEngine._refine_in_background`).

That thread replays the planner's pipeline model in Python and numpy, which hold the interpreter lock;
the decode thread's host work (dozens of PyTorch ops and native calls per layer) then waits for the lock
after each call that released it. Since session 16 the thread prices only while no step runs
(`TorchEngine._refine_pause`). This bench decodes the same request three ways, alternating, in one engine:
with no refinement, with one started just before the request and yielding (the default), and with one
that does not yield (`torch_engine.REFINE_YIELD = False`, as before), and reports each way's request wall
time (a 64-token prompt and the decode), first-token time, token times after it, and how long the
refinement took.

    python -m engine.bench.refine_contention --shape qwen3-30b-a3b --budget 2GiB --device cuda --out DIR
    python -m engine.bench.refine_contention --model bundled --device sim --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.units import parse_bytes

MODES = ("none", "yield", "no-yield")


def _open(args):
    if args.model:
        import engine
        from engine.loading.bundled import bundled_model_path

        path = bundled_model_path() if args.model == "bundled" else args.model
        eng = engine.open_model(str(path), device=args.device, backend="torch", speculative=False)
        eng.set_vram_budget(parse_bytes(args.budget))
        return eng, Path(str(path)).name
    from engine.bench.scenarios import DRY_SCENARIOS, PROMPTS, SCENARIOS
    from engine.bench.slipstream_runs import open_engine

    scenario = {**SCENARIOS, **DRY_SCENARIOS}[args.shape]
    return open_engine(scenario, parse_bytes(args.budget), args.device, max(PROMPTS) + 256), args.shape


def _drop_table(eng) -> int:
    """Forget the plans of the KV capacity in use, as a budget drop to a capacity never priced leaves it: a
    larger capacity's plans priced (the engine plans with those meanwhile), the exact one not."""
    planner, kv = eng.planner(), eng.kv_tokens
    planner.warm(2 * kv)
    planner._tables = {k: v for k, v in planner._tables.items() if k != kv}
    planner._fronts = {k: v for k, v in planner._fronts.items() if k[0] != kv}
    return kv


def _wait_refined(eng, timeout: float = 120.0) -> None:
    """Until the refinement's thread has ended (its re-plan included: the next mode must not race it)."""
    import threading

    t_end = time.monotonic() + timeout
    for t in [t for t in threading.enumerate() if t.name == "slipstream-plan-refine"]:
        t.join(max(t_end - time.monotonic(), 0.0))


def run_mode(eng, mode: str, prompt: str, n: int) -> dict:
    """Decode `n` tokens of `prompt` under `mode`; token times, and the refinement's wall time."""
    from engine.backends import torch_engine
    from engine.bench.decode_steps import token_times

    torch_engine.REFINE_YIELD = mode != "no-yield"
    if mode != "none":
        _drop_table(eng)              # (it may price the larger capacity first: outside the timed span)
    t0 = time.perf_counter()
    if mode != "none":
        eng._refine_in_background()
    times = token_times(eng, prompt, n)
    decoded = time.perf_counter()
    _wait_refined(eng)
    torch_engine.REFINE_YIELD = True
    steady = times[1:]
    return {"mode": mode, "ttft_ms": times[0] * 1e3, "median_ms": statistics.median(steady) * 1e3,
            "mean_ms": statistics.fmean(steady) * 1e3,
            "decode_s": decoded - t0, "refined_after_s": time.perf_counter() - t0 if mode != "none" else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.refine_contention", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a suite scenario (random weights)")
    ap.add_argument("--model", default=None, help="a model file instead, or 'bundled'")
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or sim")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    from engine.bench.slipstream_runs import _prompt

    eng, name = _open(args)
    prompt = _prompt(64, 3)
    run_mode(eng, "none", prompt, 8)                        # warm-up
    rows = []
    for rep in range(args.repeats):
        for mode in MODES:
            r = run_mode(eng, mode, prompt, args.tokens)
            r["repeat"] = rep
            rows.append(r)
            print(f"{mode:>9} #{rep}: median {r['median_ms']:.2f} ms/token, mean {r['mean_ms']:.2f}, decode "
                  f"{r['decode_s']:.2f} s" + (f", refined after {r['refined_after_s']:.2f} s"
                                              if r["refined_after_s"] is not None else ""), flush=True)
    summary = {}
    print("\n| refinement beside the request | request s | vs none | first token ms | median / mean ms per token "
          "after it | refinement done after s |\n|---|---|---|---|---|---|")

    def med(mode, key):
        return statistics.median(r[key] for r in rows if r["mode"] == mode)
    base = med("none", "decode_s")
    for mode in MODES:
        done = [r["refined_after_s"] for r in rows if r["mode"] == mode and r["refined_after_s"] is not None]
        summary[mode] = {k: med(mode, k) for k in ("decode_s", "ttft_ms", "median_ms", "mean_ms")}
        summary[mode].update(vs_none=summary[mode]["decode_s"] / base,
                             refined_after_s=statistics.median(done) if done else None)
        m = summary[mode]
        print(f"| {mode} | {m['decode_s']:.2f} | {m['vs_none']:.2f}x | {m['ttft_ms']:.0f} | {m['median_ms']:.2f} / "
              f"{m['mean_ms']:.2f} | " + (f"{m['refined_after_s']:.2f}" if done else "-") + " |")
    eng.close()
    path = write_report(args.out, "refine_contention",
                        {"model": name, "budget": args.budget, "device": args.device, "tokens": args.tokens,
                         "rows": rows, "summary": summary},
                        "python -m engine.bench.refine_contention " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
