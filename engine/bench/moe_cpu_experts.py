"""One decode token's routed experts of a MoE layer on the CPU, as the engine runs them (router, then
`moe.experts_blocks` over all the layer's groups), on random weights of a named shape rotated through
several layers so that every token reads its experts from DRAM.

    python -m engine.bench.moe_cpu_experts [--shape qwen3-30b-a3b] [--layers 3] [--tokens 60] [--out DIR]

Prints the median milliseconds and GB/s of expert weights read, and writes moe_cpu_experts.json (command,
machine, date) under --out.
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
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = get_shape(args.shape)
    h, inter, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):   # each group's buffer packed expert by expert, as the weight store does
        parts = []
        for r in cfg.expert_groups():
            n = len(r)
            buf = (torch.randn(n, 3 * h * inter, generator=g) * 0.02).to(torch.bfloat16)
            parts.append(({"experts.gate_up.weight": buf[:, :2 * h * inter].view(n, 2 * inter, h),
                           "experts.down.weight": buf[:, 2 * h * inter:].view(n, h, inter)}, r))
        layers.append(parts)
    router = {"ffn_norm.weight": torch.ones(h, dtype=torch.bfloat16),
              "router.weight": (torch.randn(e, h, generator=g) * 0.02).to(torch.bfloat16)}
    t_router, t_experts = [], []
    for i in range(args.tokens):
        x = torch.randn(1, h, generator=g).to(torch.bfloat16)
        t0 = time.perf_counter()
        s = moe.router_block(cfg, router, x)
        t1 = time.perf_counter()
        moe.experts_blocks(cfg, layers[i % args.layers], s)
        t_router.append(t1 - t0)
        t_experts.append(time.perf_counter() - t1)
    skip = min(6, args.tokens // 4)
    router_ms = statistics.median(t_router[skip:]) * 1e3
    experts_ms = statistics.median(t_experts[skip:]) * 1e3
    nbytes = k * 3 * h * inter * 2
    print(f"{args.shape}: router {router_ms:.3f} ms; {k} routed experts {experts_ms:.3f} ms "
          f"({nbytes / 1e6:.1f} MB at {nbytes / experts_ms / 1e6:.1f} GB/s); {kernels.status()}")
    if args.out:
        from engine.bench.gpu_common import write_report

        path = write_report(Path(args.out), "moe_cpu_experts",
                            {"threads": torch.get_num_threads(), "native": kernels.status(), "shape": args.shape,
                             "router_ms": round(router_ms, 4), "experts_ms": round(experts_ms, 4),
                             "expert_bytes": nbytes, "experts_gbps": round(nbytes / experts_ms / 1e6, 2)},
                            "python -m engine.bench.moe_cpu_experts " + " ".join(argv or sys.argv[1:]))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
