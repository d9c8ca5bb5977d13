"""Host time of each operation of a one-token GPU sub-layer run from the host, as the MoE decode runs its
GPU attention between two CPU expert layers (`OneTokenGraphs.run_host`): the hidden state staged in a pinned
buffer, copied into a captured graph's input, the replay, the output copied back to a pinned buffer, the
wait for it, the result handed on. A CUDA graph of `--kernels` small kernels over a [1, hidden] state
stands in for the attention (the H200 ran the Qwen3-30B-A3B shape's captured attention in about 0.09 ms
of kernels, session 19). Each repetition runs the whole chain; every operation is timed inside it
(perf_counter), so each figure is that operation's host time in the chain. Variants of the hand-back
(a pinned clone, a plain clone, the pinned buffer itself) and of the wait (an event polled, the stream
synchronized) are timed the same way.

    python -m engine.bench.host_path_ops [--reps 2000] [--hidden 2048] [--kernels 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report


def capture(hidden: int, kernels: int, dtype):
    """A graph of `kernels` small element-wise kernels and one [1, hidden] x [hidden, hidden] matmul, its
    static input and output."""
    w = torch.randn(hidden, hidden, device="cuda", dtype=dtype) / hidden ** 0.5
    xin = torch.zeros(1, hidden, device="cuda", dtype=dtype)

    def fn(x):
        y = x @ w
        for _ in range(kernels - 1):
            y = y * 0.999 + 0.001
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(xin)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = fn(xin)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g, xin, out


def chain(g, xin, out, x, pin_in, pin_out, hand_back: str, wait: str, clock=time.perf_counter) -> list[float]:
    """One run of the chain; the host time of each operation (s)."""
    t = [clock()]
    pin_in.copy_(x)
    t.append(clock())
    xin.copy_(pin_in, non_blocking=True)
    t.append(clock())
    g.replay()
    t.append(clock())
    pin_out.copy_(out, non_blocking=True)
    t.append(clock())
    if wait == "event":
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass
    else:
        torch.cuda.current_stream().synchronize()
    t.append(clock())
    if hand_back == "pinned clone":
        y = pin_out.clone()
    elif hand_back == "plain clone":
        y = torch.empty(pin_out.shape, dtype=pin_out.dtype)
        y.copy_(pin_out)
    else:
        y = pin_out
    t.append(clock())
    del y
    return [b - a for a, b in itertools.pairwise(t)]


STEPS = ("stage input in pinned", "copy into graph input", "replay launch", "copy output to pinned",
         "wait", "hand back")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--kernels", type=int, default=30)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_path_ops: needs a CUDA GPU", file=sys.stderr)
        return 1
    command = " ".join(["python -m engine.bench.host_path_ops"] + (argv if argv is not None else sys.argv[1:]))
    dtype = torch.bfloat16
    g, xin, out = capture(args.hidden, args.kernels, dtype)
    x = torch.randn(1, args.hidden, dtype=dtype)
    pin_in = torch.empty(xin.shape, dtype=dtype, pin_memory=True)
    pin_out = torch.empty(out.shape, dtype=dtype, pin_memory=True)
    variants = [("pinned clone", "event"), ("plain clone", "event"), ("pinned buffer", "event"),
                ("pinned clone", "stream sync")]
    rows = []
    for hand_back, wait in variants:
        for _ in range(50):
            chain(g, xin, out, x, pin_in, pin_out, hand_back, wait)
        runs = [chain(g, xin, out, x, pin_in, pin_out, hand_back, wait) for _ in range(args.reps)]
        med = {s: statistics.median(r[i] for r in runs) * 1e6 for i, s in enumerate(STEPS)}
        total = statistics.median(sum(r) for r in runs) * 1e6
        rows.append({"hand_back": hand_back, "wait": wait, "us": med, "total_us": total})
    # the graph's own GPU time, from events around back-to-back replays
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        g.replay()
    end.record()
    end.synchronize()
    gpu_us = start.elapsed_time(end) * 1e3 / 200
    print(f"graph of {args.kernels} kernels: {gpu_us:.1f} us of GPU time a replay (back to back)")
    print("| hand back | wait | " + " | ".join(STEPS) + " | total |")
    print("|---|---|" + "---:|" * (len(STEPS) + 1))
    for r in rows:
        print(f"| {r['hand_back']} | {r['wait']} | " + " | ".join(f"{r['us'][s]:.1f}" for s in STEPS)
              + f" | {r['total_us']:.1f} |")
    res = {"reps": args.reps, "hidden": args.hidden, "kernels": args.kernels, "graph_gpu_us": gpu_us, "rows": rows,
           "unit": "microseconds of host time, median over repetitions"}
    path = write_report(Path(args.out), "host_path_ops", res, command)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
