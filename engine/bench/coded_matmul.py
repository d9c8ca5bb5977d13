"""The native CPU matmul over a transfer-coded matrix (read in place, 75% of the bytes) against the same
matrix raw, at a few rows: whether the CPU side of a decode would gain from reading coded weights.

    python -m engine.bench.coded_matmul --out DIR [--rows 1,4] [--reps 15]

Llama-3-8B's FFN shapes (gate and up together [28672, 4096], down [4096, 14336]), normal bf16 at 0.02.
Both give the same bits (checked here). Prints a table; writes DIR/coded_matmul.json (command, machine,
date). The decode does not use this path yet: its rate on the machine that runs the decode decides that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}     # [rows, columns]


def _median_s(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="which of: " + ", ".join(SHAPES))
    ap.add_argument("--prefetch", default="",
                    help="prefetch distances (elements, comma-separated; kernels.set_prefetch) each row is timed at, "
                         "in turns (default: the kernel's own)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from engine import kernels
    from engine.bench.gpu_common import machine_info
    from engine.sharding import transfer_code as tc

    status = kernels.status(wait=True)
    if not kernels.coded_ready():
        print(f"the native kernel does not read coded matrices here ({status})")
        return 1
    g = torch.Generator().manual_seed(0)
    rows_out, exact = [], True
    pfs = [int(v) for v in a.prefetch.split(",") if v] or [None]
    pf_default = kernels.prefetch()
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, generator=g) * a.scale).to(torch.bfloat16)
        raw = w.view(-1).view(torch.uint8)
        layout = tc.plan(raw, segments=[(0, n * k, k)])
        coded = tc.encode_into(raw, layout, torch.empty(tc.coded_size(*layout[1:]), dtype=torch.uint8))
        mat = tc.CpuMatrix(coded, 0, n, k)
        for m, pf in ((int(r), pf) for r in a.rows.split(",") for pf in pfs):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            if pf is not None:
                kernels.set_prefetch(pf)
            want, got = kernels.linear(x, w, min_weights=0), kernels.linear_coded(x, mat, n, k)
            exact = exact and want is not None and got is not None and torch.equal(want, got)
            t_raw = _median_s(lambda x=x, w=w: kernels.linear(x, w, min_weights=0), a.reps)
            t_coded = _median_s(lambda x=x, mat=mat, n=n, k=k: kernels.linear_coded(x, mat, n, k), a.reps)
            rows_out.append({"shape": f"{name} [{n}, {k}]", "rows": m, "prefetch": kernels.prefetch(),
                             "raw_ms": round(t_raw * 1e3, 3),
                             "coded_ms": round(t_coded * 1e3, 3),
                             "raw_gbps": round(2 * n * k / t_raw / 1e9, 1),
                             "coded_weights_gbps": round(2 * n * k / t_coded / 1e9, 1),
                             "coded_bytes_gbps": round(coded.nbytes / t_coded / 1e9, 1),
                             "speedup": round(t_raw / t_coded, 3)})
    if pf_default is not None:
        kernels.set_prefetch(pf_default)
    result = {"command": "python -m engine.bench.coded_matmul " + " ".join(argv or sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
              "cpu_matmul": status, "threads": torch.get_num_threads(), "exact": exact, "rows": rows_out}
    print(f"{status}; same bits: {exact}")
    print("| matrix | rows | prefetch | raw ms | coded ms | raw GB/s | coded, GB/s of weights | coded / raw |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows_out:
        print(f"| {r['shape']} | {r['rows']} | {r['prefetch']} | {r['raw_ms']} | {r['coded_ms']} | {r['raw_gbps']} | "
              f"{r['coded_weights_gbps']} | {r['speedup']}x |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "coded_matmul.json").write_text(json.dumps(result, indent=1))
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
