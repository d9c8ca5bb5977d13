"""Host -> GPU copy rate of one FFN-sized buffer from three kinds of page-locked host memory: a block of
PyTorch's pinned allocator of its own, a slice of a larger pinned chunk (how the engine packs its
weights, `engine.sharding.device.host_buffers`), and an ordinary allocation registered with the driver
(cudaHostRegister). Shows whether the way the host memory is locked changes what streaming gets.

    python -m engine.bench.host_copy_rate --mib 336 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engine.bench.gpu_common import h2d_gbps, write_report
from engine.sharding.device import host_buffers

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=336, help="buffer size (an 8B model's FFN block: 336 MiB)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_copy_rate: needs a CUDA GPU", file=sys.stderr)
        return 2
    n = args.mib * MiB
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    kinds = {"pinned block of its own": torch.empty(n, dtype=torch.uint8, pin_memory=True),
             "slice of a pinned chunk": host_buffers([n, n // 3], pin=True)[0]}
    plain = torch.empty(n, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    registered = int(cudart.cudaHostRegister(plain.data_ptr(), n, 0)) == 0
    if registered:
        kinds["registered ordinary memory"] = plain
    rows = {}
    for name, src in kinds.items():
        src.fill_(1)
        rows[name] = round(h2d_gbps(src, args.reps, dst), 2)
        print(f"  {name:28s} {rows[name]:6.1f} GB/s", flush=True)
    if registered:
        cudart.cudaHostUnregister(plain.data_ptr())
    if args.out is not None:
        write_report(args.out, "host_copy_rate", {"bytes": n, "gbps": rows},
                     " ".join(["python -m engine.bench.host_copy_rate", *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
