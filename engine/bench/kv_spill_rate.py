"""How fast a KV cache's blocks move between its host-memory pools and its host-RAM tier: one sequence's
blocks copied to the tier and back (`PagedKVCache._copy`, the copies of a spill and of a restore), every
layer, by PyTorch (one copy per layer, part and run) and by the native pool (`kernels.copy_many`, one
call), taking turns. A prompt that
finds another prompt's blocks cached spills them to the tier before its first step; for the layers whose
cache lies in host memory that is this copy (session 24, call BJ0: 71 ms of a 313 ms 4096-token step of the
Llama-3-8B shape at 4 GiB, with PyTorch's copies).

    python -m engine.bench.kv_spill_rate --shape llama3-8b --tokens 4096 --out DIR

Runs on the CPU alone (the cache's "GPU" is the sim device's host memory).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.kv_spill_rate", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=4, help="offload and restore rounds per copy path")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    from engine import kernels
    from engine.bench.shapes import get_shape
    from engine.sharding.device import Accelerator
    from engine.sharding.kvcache import BLOCK_SIZE, PagedKVCache, Sequence

    cfg = get_shape(args.shape)
    acc = Accelerator("sim")
    acc.budget = 1 << 50
    kv = PagedKVCache(cfg, torch.bfloat16, acc, host_bytes=2 * args.tokens * cfg.num_layers * 2 * cfg.num_kv_heads
                      * cfg.head_dim * 2 + (64 << 20))
    kv._grow(-(-args.tokens // BLOCK_SIZE) + 1)
    seq = Sequence()
    seq.token_ids.extend(random.Random(0).randrange(50000) for _ in range(args.tokens))
    kv.reserve(seq, args.tokens)
    seq.length = args.tokens
    nbytes = args.tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    blocks = list(seq.block_table)
    kv.offload(seq)                    # (the tier's and the pools' pages touched once before the timed rounds)
    slots = sorted(seq.host_slots)
    kv.restore(seq)
    pairs = list(zip(sorted(blocks), slots))     # the copies a spill and a restore of these blocks make
    rows = []
    was = kernels.set_enabled(True)
    try:
        for rep in range(args.reps):
            for native in (False, True) if rep % 2 == 0 else (True, False):
                kernels.set_enabled(native)
                t0 = time.perf_counter()
                kv._copy(pairs, to_host=True)
                t1 = time.perf_counter()
                kv._copy(pairs, to_host=False)
                t2 = time.perf_counter()
                rows.append({"rep": rep, "native": native, "offload_ms": (t1 - t0) * 1e3, "restore_ms": (t2 - t1) * 1e3})
    finally:
        kernels.set_enabled(was)
    print(f"{args.shape}, {args.tokens} tokens x {cfg.num_layers} layers: {nbytes / 2**20:.0f} MiB each way; "
          f"CPU matmul path: {kernels.status(wait=True)}; torch threads {torch.get_num_threads()}")
    print("| copies | offload ms (median) | GB/s | restore ms (median) | GB/s |\n|---|---:|---:|---:|---:|")
    summary = {}
    for native in (False, True):
        off = statistics.median(r["offload_ms"] for r in rows if r["native"] is native)
        back = statistics.median(r["restore_ms"] for r in rows if r["native"] is native)
        name = "native pool, one call" if native else "PyTorch, one copy each"
        summary[name] = {"offload_ms": off, "restore_ms": back}
        print(f"| {name} | {off:.1f} | {nbytes / off / 1e6:.1f} | {back:.1f} | {nbytes / back / 1e6:.1f} |")
    path = write_report(args.out, "kv_spill_rate", {"shape": args.shape, "tokens": args.tokens, "bytes": nbytes,
                                                    "rows": rows, "summary": summary},
                        "python -m engine.bench.kv_spill_rate " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
