"""A decode step's routed experts of a MoE layer on the CPU, as the engine runs them (router, then
`moe.experts_blocks` over all the layer's groups), on random weights of a named shape rotated through
several layers so that every step reads its experts from DRAM; for one token and for batches.

    python -m engine.bench.moe_cpu_experts [--shape qwen3-30b-a3b] [--layers 3] [--tokens 60]
                                           [--batches 1,4,16] [--pinned] [--gap-us 600] [--out DIR]

Prints, per batch size, the median milliseconds of the router and of the experts (and of the experts'
time, how much was spent inside the native jobs: the rest is host work), the distinct experts
the batch touched, the GB/s of their weights read, the same step through the whole layer in one native
call (`moe.layer_cpu`, as the decode runs a layer whose experts are all on the CPU: norm, router and experts,
its GB/s over the router's and the experts' bytes), and the path they took (the native kernel over every
routed expert in one call (on AMX tiles past 16 rows an expert, where the CPU has them), or PyTorch expert
by expert where one has more rows than `kernels.max_rows_stacked`: 16 without the tiles);
writes moe_cpu_experts.json (command, machine, date) under --out. The one-token row's fields stay at the
top level, as earlier reports had them. `--pinned` keeps the weights in page-locked memory as the engine does
beside a GPU; `--gap-us N` waits N microseconds (the host busy, as while a GPU attention runs) before each
timed step, so the pool's workers have gone to sleep as they have between a decode's CPU layers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from engine import kernels
    from engine.bench.shapes import get_shape
    from engine.models import moe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=3, help="layers of weights to rotate through")
    ap.add_argument("--tokens", type=int, default=60, help="steps timed per batch size")
    ap.add_argument("--batches", default="1", help="tokens per step, comma-separated (e.g. 1,4,16)")
    ap.add_argument("--pinned", action="store_true", help="weights in page-locked memory (needs CUDA)")
    ap.add_argument("--gap-us", type=float, default=0.0, help="busy host time before each timed step")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.pinned and not torch.cuda.is_available():
        ap.error("--pinned needs CUDA (page-locked memory)")
    from engine.bench.scenarios import DRY_CONFIGS

    cfg = DRY_CONFIGS[args.shape]() if args.shape in DRY_CONFIGS else get_shape(args.shape)   # (tiny-moe: tests)
    h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):   # each group's buffer packed expert by expert, as the weight store does
        parts = []
        for r in cfg.expert_groups():
            n = len(r)
            buf = (torch.randn(n, 3 * h * inter, generator=g) * 0.02).to(torch.bfloat16)
            if args.pinned:
                buf = buf.pin_memory()
            parts.append(({"experts.gate_up.weight": buf[:, :2 * h * inter].view(n, 2 * inter, h),
                           "experts.down.weight": buf[:, 2 * h * inter:].view(n, h, inter)}, r))
        layers.append(parts)
    router = {"ffn_norm.weight": torch.ones(h, dtype=torch.bfloat16),
              "router.weight": (torch.randn(e, h, generator=g) * 0.02).to(torch.bfloat16)}
    tables = [moe.expert_table(cfg, parts) for parts in layers]
    expert_bytes = 3 * h * inter * 2
    router_bytes = e * h * 2

    def gap():
        end = time.perf_counter() + args.gap_us / 1e6
        while time.perf_counter() < end:
            pass
    in_kernel = [0.0]                 # seconds inside the native batched jobs (the rest is host work)
    real_batch = kernels._batch

    def timed_batch(*a):
        t = time.perf_counter()
        try:
            return real_batch(*a)
        finally:
            in_kernel[0] += time.perf_counter() - t

    kernels._batch = timed_batch
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        t_router, t_experts, t_kernel, t_layer, touched, widest = [], [], [], [], [], 0
        for i in range(args.tokens):
            x = torch.randn(batch, h, generator=g).to(torch.bfloat16)
            if tables[0] is not None and batch <= kernels.MOE_MAX_T:
                gap()
                t0 = time.perf_counter()
                done = moe.layer_cpu(cfg, router, layers[(i + 1) % args.layers], x, tables[(i + 1) % args.layers])
                if done is not None:
                    t_layer.append(time.perf_counter() - t0)
            gap()
            t0 = time.perf_counter()
            s = moe.router_block(cfg, router, x)
            t1 = time.perf_counter()
            in_kernel[0] = 0.0
            moe.experts_blocks(cfg, layers[i % args.layers], s)
            t_router.append(t1 - t0)
            t_experts.append(time.perf_counter() - t1)
            t_kernel.append(in_kernel[0])
            counts = [s.bounds[j + 1] - s.bounds[j] for j in range(e)]
            touched.append(sum(c > 0 for c in counts))
            widest = max(widest, max(counts))
        skip = min(6, args.tokens // 4)
        router_ms = statistics.median(t_router[skip:]) * 1e3
        experts_ms = statistics.median(t_experts[skip:]) * 1e3
        kernel_ms = statistics.median(t_kernel[skip:]) * 1e3
        nbytes = statistics.median(touched) * expert_bytes
        layer_ms = statistics.median(t_layer[skip:]) * 1e3 if len(t_layer) > skip else None
        path = ("native" if widest <= kernels.max_rows_many(torch.bfloat16)
                else "native, AMX tiles past 16 rows" if widest <= kernels.max_rows_stacked(torch.bfloat16)
                else "PyTorch expert by expert: one had more rows than max_rows_stacked")
        rows.append({"batch": batch, "router_ms": round(router_ms, 4), "experts_ms": round(experts_ms, 4),
                     "kernel_ms": round(kernel_ms, 4), "bulk": moe._BULK,
                     "touched_experts": statistics.median(touched), "most_rows_per_expert": widest,
                     "expert_bytes": int(nbytes), "experts_gbps": round(nbytes / experts_ms / 1e6, 2), "path": path,
                     "layer_call_ms": round(layer_ms, 4) if layer_ms else None,
                     "layer_call_gbps": round((nbytes + router_bytes) / layer_ms / 1e6, 2) if layer_ms else None})
        print(f"{args.shape} batch {batch}: router {router_ms:.3f} ms; {statistics.median(touched):g} experts "
              f"touched {experts_ms:.3f} ms, {kernel_ms:.3f} in the native jobs ({nbytes / 1e6:.1f} MB at "
              f"{nbytes / experts_ms / 1e6:.1f} GB/s; "
              f"up to {widest} rows per expert: {path}); "
              + (f"the layer in one call {layer_ms:.3f} ms ({(nbytes + router_bytes) / layer_ms / 1e6:.1f} GB/s); "
                 if layer_ms else "") + f"{kernels.status()}", flush=True)
    if args.out:
        from engine.bench.gpu_common import write_report

        one = next((r for r in rows if r["batch"] == 1), rows[0])
        path = write_report(Path(args.out), "moe_cpu_experts",
                            {"threads": torch.get_num_threads(), "native": kernels.status(), "shape": args.shape,
                             "pinned": args.pinned, "gap_us": args.gap_us,
                             **{k: one[k] for k in ("router_ms", "experts_ms", "expert_bytes", "experts_gbps")},
                             "batches": rows},
                            "python -m engine.bench.moe_cpu_experts " + " ".join(argv or sys.argv[1:]))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
