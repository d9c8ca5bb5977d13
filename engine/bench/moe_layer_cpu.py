"""One MoE layer on the CPU: the tensor path (router, expert groups, residual add one by one) against the
one-call path (`moe.layer_cpu`), at full width, for steps of 1, 4 and 16 tokens; and silu times up
(`kernels.silu_mul`) against PyTorch's.

    python -m engine.bench.moe_layer_cpu --out docs/benchmarks

The Qwen3-30B-A3B shape's layer (128 experts in 8 groups, top 8, bf16, gate and up stacked), random
weights. Each step's output is compared bit for bit between the two paths, then each is timed (median of
`--reps` runs after two warm-ups; the same tokens each run, so the routed experts' weights are partly in
cache). Writes a table and moe_layer_cpu.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report


def _median_us(fn, reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.moe_layer_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)

    from engine import kernels
    from engine.bench.shapes import get_shape
    from engine.models import moe

    cfg = dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=1)
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    groups = []
    for e0 in range(0, E, E // 8):
        n = E // 8
        groups.append(({"experts.gate_up.weight": (torch.randn(n, 2 * inter, H, generator=g) * 0.02).to(bf),
                        "experts.down.weight": (torch.randn(n, H, inter, generator=g) * 0.02).to(bf)},
                       range(e0, e0 + n)))
    router = {"ffn_norm.weight": (1 + 0.1 * torch.randn(H, generator=g)).to(bf),
              "router.weight": (torch.randn(E, H, generator=g) * 0.02).to(bf)}
    table = moe.expert_table(cfg, groups)
    rows = []
    for t in [int(s) for s in args.tokens.split(",")]:
        x = torch.randn(t, H, generator=g).to(bf)

        def tensor_path(x=x):
            return moe.finish(moe.experts_blocks(cfg, groups, moe.router_block(cfg, router, x)))

        def one_call(x=x):
            return moe.layer_cpu(cfg, router, groups, x, table)

        same = torch.equal(tensor_path().view(torch.int16), one_call().view(torch.int16))
        rows.append({"tokens": t, "same_bits": same, "tensor_path_us": round(_median_us(tensor_path, args.reps), 1),
                     "one_call_us": round(_median_us(one_call, args.reps), 1)})
    gate = torch.randn(8 * inter, generator=g).to(bf)
    up = torch.randn(8 * inter, generator=g).to(bf)
    silu = {"values": gate.numel(), "native_us": round(_median_us(lambda: kernels.silu_mul(gate, up), 500), 1),
            "torch_us": round(_median_us(lambda: torch.nn.functional.silu(gate) * up, 500), 1)}
    print("\n| tokens | same bits | tensor path (us) | one call (us) | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['same_bits']} | {r['tensor_path_us']:.0f} | {r['one_call_us']:.0f} | "
              f"{r['tensor_path_us'] / r['one_call_us']:.2f}x |")
    print(f"\nsilu times up, {silu['values']} values: native {silu['native_us']} us (with its Python wrapper), "
          f"PyTorch {silu['torch_us']} us")
    path = write_report(args.out, "moe_layer_cpu", {"rows": rows, "silu_mul": silu, "cpu_matmul": kernels.status(),
                                                    "threads": torch.get_num_threads()},
                        "python -m engine.bench.moe_layer_cpu " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
