"""Diagnostics for the CPU side of a plan on this machine: time each sub-layer of one decode step
(synchronised after each) and compare CPU GEMV speed from pinned and from ordinary host memory.

    python -m engine.bench.diag_cpu_path --shape llama3-8b --budget 4GiB --kind static
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from engine.bench.gpu_common import open_shape
from engine.models import dense


def gemv_gbps(w: torch.Tensor, reps: int = 20) -> float:
    x = torch.randn(1, w.shape[1], dtype=w.dtype)
    F.linear(x, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        F.linear(x, w)
    return w.numel() * w.element_size() * reps / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--kind", default="static")
    args = ap.parse_args(argv)
    print("torch threads", torch.get_num_threads())
    w = torch.randn(14336, 4096, dtype=torch.bfloat16)
    print(f"GEMV ordinary memory: {gemv_gbps(w):.1f} GB/s")
    if torch.cuda.is_available():
        wp = w.pin_memory()
        print(f"GEMV pinned memory:   {gemv_gbps(wp):.1f} GB/s")
    eng = open_shape(args.shape, args.budget)
    eng.force_plan(args.kind)
    list(eng.generate("x" * 32, max_new_tokens=4))
    timings: dict[str, list[float]] = {}
    sync = eng.accel.synchronize

    def timed(fn, kind):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            timings.setdefault(kind + ("@cpu" if a[2].device.type == "cpu" else "@gpu") if kind != "embed"
                               else kind, []).append(time.perf_counter() - t0)
            return out
        return run

    orig_ffn, orig_attn = dense.ffn_block, dense.attention_block
    dense.ffn_block = timed(orig_ffn, "ffn")
    dense.attention_block = timed(lambda cfg, w, x, *r: orig_attn(cfg, w, x, *r), "attn")
    t0 = time.perf_counter()
    n = 0
    for ev in eng.generate("x" * 32, max_new_tokens=16):
        n += 1
    total = time.perf_counter() - t0
    dense.ffn_block, dense.attention_block = orig_ffn, orig_attn
    t1 = time.perf_counter()
    for ev in eng.generate("x" * 32, max_new_tokens=16):
        pass
    untimed = time.perf_counter() - t1
    print(f"plan {[t['plan'] for t in eng.plan_report()['tiers']][:3]}; {n} tokens in {total:.2f} s with syncs, "
          f"{untimed:.2f} s without")
    for k, v in sorted(timings.items()):
        print(f"{k:10s} calls {len(v):5d} median {statistics.median(v) * 1e3:7.2f} ms  sum {sum(v):6.2f} s")
    eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
