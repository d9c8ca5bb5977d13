"""The CPU side of decode: native small-batch matmul (engine.kernels) against PyTorch's, and the engine's
CPU FFN block with each, on FFN-shaped weights rotated through a set larger than the CPU caches.

    python -m engine.bench.cpu_matmul [--hidden 4096 --ffn 14336] [--rotate-gib 1.5] [--out DIR]

Prints a table and writes cpu_matmul.json (command, machine, date) under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine import kernels
from engine.config import ModelConfig
from engine.models import dense

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _rate(fn, nbytes: int, count: int, min_s: float) -> float:
    """GB/s of weights read: median over repeats of a pass through the rotating set."""
    fn(0)
    times = []
    t_end = time.perf_counter() + min_s
    i = 0
    while time.perf_counter() < t_end or len(times) < 5:
        t0 = time.perf_counter()
        for _ in range(count):
            fn(i)
            i += 1
        times.append((time.perf_counter() - t0) / count)
    return nbytes / statistics.median(times) / 1e9


def read_bandwidth(gib: float) -> float:
    """Host memory read rate of a float32 sum over `gib` GiB (PyTorch, all threads), GB/s."""
    a = torch.ones(int(gib * 2**30) // 4)
    a.sum()
    t0 = time.perf_counter()
    for _ in range(3):
        a.sum()
    return 3 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--rotate-gib", type=float, default=1.5)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--min-s", type=float, default=0.5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    h, f = args.hidden, args.ffn
    print(f"threads {torch.get_num_threads()}; native path: {kernels.status()}", flush=True)
    rows_out = []
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        per = 2 * f * h * dt.itemsize
        count = max(2, int(args.rotate_gib * 2**30 // per))
        ws = [torch.randn(2 * f, h).to(dt) for _ in range(count)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, h).to(dt)
            row = {"dtype": name, "rows": m, "shape": [2 * f, h]}
            for path, on in (("native", True), ("torch", False)):
                kernels.set_enabled(on)
                row[f"{path}_gbps"] = round(_rate(lambda i, x=x, ws=ws, count=count: dense.linear(x, ws[i % count]), per, count,
                                                  args.min_s), 2)
            kernels.set_enabled(True)
            rows_out.append(row)
            print(f"{name:9s} rows {m:3d}: native {row['native_gbps']:7.1f} GB/s   torch {row['torch_gbps']:7.1f}"
                  f" GB/s   x{row['native_gbps'] / row['torch_gbps']:.2f}", flush=True)
        del ws
    # the engine's CPU FFN block (norm, fused gate/up, SwiGLU, down), bf16, one token
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=h, intermediate_size=f, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=h, dtype="bfloat16")
    per = 3 * f * h * 2
    count = max(2, int(args.rotate_gib * 2**30 // per))
    blocks = [{"ffn_norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "gate_up.weight": torch.randn(2 * f, h).to(torch.bfloat16),
               "down.weight": torch.randn(h, f).to(torch.bfloat16)} for _ in range(count)]
    x = torch.randn(1, h).to(torch.bfloat16)
    block = {}
    for path, on in (("native", True), ("torch", False)):
        kernels.set_enabled(on)
        block[f"{path}_gbps"] = round(_rate(lambda i, blocks=blocks: dense.ffn_block(cfg, blocks[i % count], x), per, count,
                                            args.min_s), 2)
    kernels.set_enabled(True)
    block["native_ms"] = round(per / block["native_gbps"] / 1e6, 3)
    print(f"FFN block bf16, 1 token ({per / 1e6:.0f} MB): native {block['native_gbps']:.1f} GB/s "
          f"({block['native_ms']:.2f} ms)   torch {block['torch_gbps']:.1f} GB/s", flush=True)
    del blocks
    bw = round(read_bandwidth(min(args.rotate_gib, 2.0)), 1)
    print(f"host memory read (float32 sum): {bw} GB/s", flush=True)
    result = {"command": "python -m engine.bench.cpu_matmul " + " ".join(argv or sys.argv[1:]),
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "native": kernels.status()},
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "matmul": rows_out, "ffn_block": block, "read_gbps": bw}
    if args.out:
        out = Path(args.out) / "cpu_matmul.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
