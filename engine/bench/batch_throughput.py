"""Throughput of concurrent streams under continuous batching, at a fixed VRAM budget.

For each stream count S, S requests (distinct prompts of --prompt-tokens tokens, --new-tokens greedy
tokens each; the random model's byte tokenizer has no end-of-sequence token, so every request runs to
its length) are submitted at once and the wall time until all are done is measured. Reported per S:
aggregate tokens/s (all streams' generated tokens over the wall time), per-stream decode tokens/s and
time to first token (medians over the streams), the steps run, the largest batch, preemptions, the
plan of the decode tier and the weight bytes streamed per step.

    python -m engine.bench.batch_throughput --device cuda --shape llama3-8b --budget 4GiB --streams 1,4,16
    python -m engine.bench.batch_throughput --device sim --shape tiny --out /tmp/bench   # a quick check

Random weights (speed does not depend on their values); the KV capacity is grown to the largest run's
need before timing, so no re-plan falls inside a measurement.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.config import ModelConfig
from engine.units import format_bytes, parse_bytes

# A shape small enough for the CPU: checks that the script runs (its figures mean nothing).
TINY = ModelConfig(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=2048)


def open_engine(shape: str, device: str, budget: int, n_ctx: int, max_kv_tokens: int):
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = TINY if shape == "tiny" else get_shape(shape)
    loaded = random_model(cfg, seed=0, name=shape)
    return TorchEngine(loaded, device=device, vram_budget=budget, n_ctx=n_ctx, max_kv_tokens=max_kv_tokens,
                       speculative=False)


def prompts(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    return ["".join(rng.choice(letters) for _ in range(length)) for _ in range(n)]


def decode_rate(req) -> float:
    """Tokens per second of one stream after its first token (as the scheduler produced them)."""
    return (req.generated - 1) / (req.t_last - req.t_first) if req.generated > 1 else 0.0


def decode_aggregate(reqs) -> float | None:
    """Tokens per second of all streams together once every one of them has its first token (every
    prompt is in): the tokens sampled after that moment over the time to the last token, as
    llama-batched-bench's decode figure (S_TG) counts its batch's tokens after the prompts; None where
    nothing came after it."""
    start = max(r.t_first for r in reqs)
    end = max(r.t_last for r in reqs)
    n = sum(1 for r in reqs for t in r.token_times if t > start)
    return n / (end - start) if n and end > start else None


def run_streams(eng, n_streams: int, prompt_tokens: int, new_tokens: int, seed: int) -> dict:
    """Submit `n_streams` requests at once; time them to the end."""
    eng.scheduler.counters["max_batch_size"] = 0
    before = eng.stats()
    copied = eng.executor.copied_bytes
    t0 = time.perf_counter()
    handles = [eng.submit(p, max_new_tokens=new_tokens) for p in prompts(n_streams, prompt_tokens, seed)]
    done = [h.result() for h in handles]
    wall = time.perf_counter() - t0
    after = eng.stats()
    generated = sum(len(c.token_ids) for c in done)
    steps = after["batch_steps"] - before["batch_steps"]
    decode_plan = eng.planset.for_tokens(n_streams)
    placement = [str(p) for p in decode_plan.placement.values()]
    return {
        "streams": n_streams, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "generated_tokens": generated, "wall_s": wall,
        "aggregate_tokens_per_s": generated / wall,
        "decode_aggregate_tokens_per_s": decode_aggregate([h.request for h in handles]),
        "per_stream_tokens_per_s": statistics.median(decode_rate(h.request) for h in handles),
        "ttft_s_median": statistics.median(h.request.t_first - h.request.submitted for h in handles),
        "steps": steps, "max_batch_size": after["max_batch_size"],
        "preemptions": after["preemptions"] - before["preemptions"],
        "streamed_bytes_per_step": (eng.executor.copied_bytes - copied) / max(steps, 1),
        "decode_plan": {"tier": decode_plan.tier, "kind": decode_plan.kind,
                        "predicted_ms": decode_plan.predicted_ms,
                        "resident": placement.count("resident"), "streamed": placement.count("streamed"),
                        "cpu": placement.count("cpu")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", help="a named shape (engine.bench.shapes) or 'tiny'")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, sim or cpu")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", default="docs/benchmarks/gpu")
    args = ap.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    budget = parse_bytes(args.budget, "--budget")
    per_request = args.prompt_tokens + args.new_tokens
    n_ctx = per_request + 16
    eng = open_engine(args.shape, args.device, budget, n_ctx, max(max(streams) * n_ctx, n_ctx))
    # Grow the KV capacity (a re-plan) to the largest run's need now, then warm up.
    eng._ensure_kv_capacity(max(streams) * per_request)
    run_streams(eng, min(4, max(streams)), args.prompt_tokens, 4, seed=99)
    rows = []
    print(f"{args.shape} on {args.device}, budget {format_bytes(budget)}: {args.prompt_tokens}-token prompts, "
          f"{args.new_tokens} new tokens per stream")
    print(f"{'streams':>7} {'agg tok/s':>10} {'per-stream':>10} {'ttft s':>8} {'steps':>6} {'batch':>5} "
          f"{'preempt':>7} {'plan':>9} {'res/str/cpu':>12} {'streamed/step':>14}")
    for s in streams:
        row = run_streams(eng, s, args.prompt_tokens, args.new_tokens, seed=s)
        rows.append(row)
        p = row["decode_plan"]
        print(f"{s:>7} {row['aggregate_tokens_per_s']:>10.1f} {row['per_stream_tokens_per_s']:>10.1f} "
              f"{row['ttft_s_median']:>8.2f} {row['steps']:>6} {row['max_batch_size']:>5} {row['preemptions']:>7} "
              f"{p['kind']:>9} {p['resident']:>4}/{p['streamed']}/{p['cpu']:<4} "
              f"{format_bytes(int(row['streamed_bytes_per_step'])):>14}", flush=True)
    base = rows[0]["aggregate_tokens_per_s"] if rows else 0.0
    for row in rows:
        row["speedup_vs_first"] = row["aggregate_tokens_per_s"] / base if base else None
    eng.close()
    path = write_report(Path(args.out), "batch_throughput",
                        {"shape": args.shape, "device": args.device, "budget": budget, "rows": rows},
                        " ".join(["python -m engine.bench.batch_throughput"] + (argv or sys.argv[1:])))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
