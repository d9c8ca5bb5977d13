"""The CPU side of decode: native small-batch matmul (engine.kernels) against PyTorch's, and the engine's
CPU FFN block with each, on FFN-shaped weights rotated through a set larger than the CPU caches.

    python -m engine.bench.cpu_matmul [--hidden 4096 --ffn 14336] [--rotate-gib 1.5] [--out DIR]
    python -m engine.bench.cpu_matmul --rows 1,16,64,512 --dtypes bfloat16 --engine-path --beside-copies \
        --profile-file docs/benchmarks/profiles/h200.json

`--engine-path` adds the rate of `dense.linear` as the engine calls it (the native kernel up to
`kernels.max_rows` rows, PyTorch past them); `--beside-copies` keeps pinned host -> GPU copies running on a
side stream through every timed call, as a decode or a prompt streams weights (CUDA only); `--profile-file`
sets beside each row what the profile's CPU GEMM table prices the same matmul at (the estimator's price of
the CPU side of every plan: session 20 found the CPU's rows of split FFNs 3-8x slower than it). Rates are
GB/s of weights read and GFLOP/s. Prints a table and writes cpu_matmul.json (command, machine, date) under
--out.
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
    ap.add_argument("--engine-path", action="store_true",
                    help="also time dense.linear as the engine takes it (native up to kernels.max_rows rows)")
    ap.add_argument("--beside-copies", action="store_true",
                    help="pinned host -> GPU copies running through every timed call (needs CUDA)")
    ap.add_argument("--profile-file", default=None,
                    help="a profile database file: print its CPU GEMM price of each matmul beside the rates")
    ap.add_argument("--prefetch", default="",
                    help="prefetch distances (elements, comma-separated, repeats allowed: 0,512,0,512) the native "
                         "path and the FFN block take turns at (kernels.set_prefetch); each row reports the median "
                         "of each distance's turns")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pfs = [int(v) for v in args.prefetch.split(",") if v] or [None]
    if any(v is not None and v < 0 for v in pfs):
        ap.error(f"--prefetch {args.prefetch}: distances must be at least 0")
    pf_default = kernels.prefetch()
    if args.beside_copies and not torch.cuda.is_available():
        print("--beside-copies needs CUDA", file=sys.stderr)
        return 1
    prof = None
    if args.profile_file:
        from engine.commands.plan import profile_from_file

        prof = profile_from_file(args.profile_file)
    copier = None
    if args.beside_copies:
        from engine.bench.cpu_call_phases import Copier

        copier = Copier()
    h, f = args.hidden, args.ffn
    print(f"threads {torch.get_num_threads()}; native path: {kernels.status()}"
          f"{'; beside host -> GPU copies' if copier else ''}", flush=True)
    rows_out = []
    def pf_name(pf):
        return "native" if pf is None else f"native_pf{pf}"
    native = tuple((pf_name(pf), True) for pf in dict.fromkeys(pfs))
    paths = native + (("torch", False),) + ((("engine", None),) if args.engine_path else ())
    for name in args.dtypes.split(","):
        dt = DTYPES[name]
        per = 2 * f * h * dt.itemsize
        count = max(2, int(args.rotate_gib * 2**30 // per))
        ws = [torch.randn(2 * f, h).to(dt) for _ in range(count)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, h).to(dt)
            row = {"dtype": name, "rows": m, "shape": [2 * f, h]}
            turns = [(pf_name(pf), True, pf) for pf in pfs] + [(p, on, None) for p, on in paths[len(native):]]
            taken: dict[str, list[float]] = {}
            for path, on, pf in turns:
                if path.startswith("native") and not kernels.usable(x, ws[0], rows=1 << 30):
                    row[f"{path}_gbps"] = None      # (past what the native kernel takes at all)
                    continue
                kernels.set_enabled(on is not False)
                if pf is not None:
                    kernels.set_prefetch(pf)

                def call(i, x=x, ws=ws, count=count, native=on is True):
                    if copier is not None:
                        copier.top_up()
                    if native:
                        y = kernels.linear(x, ws[i % count], rows=1 << 30)
                        if y is not None:
                            return y
                    return dense.linear(x, ws[i % count])
                taken.setdefault(path, []).append(round(_rate(call, per, count, args.min_s), 2))
            for path, rates in taken.items():
                row[f"{path}_gbps"] = round(statistics.median(rates), 2)
                if len(rates) > 1:
                    row[f"{path}_turns_gbps"] = rates
            kernels.set_enabled(True)
            if pf_default is not None:
                kernels.set_prefetch(pf_default)
            flops = 2 * m * per / dt.itemsize
            for path, _ in paths:
                gbps = row.get(f"{path}_gbps")
                row[f"{path}_gflops"] = round(gbps * flops / per, 1) if gbps else None
            if prof is not None:
                ms = prof.gemm_ms("cpu", name, "ffn", flops / m, m)
                row["priced_gbps"] = round(per / ms / 1e6, 2)
            rows_out.append(row)
            cells = "   ".join(f"{p} {row.get(f'{p}_gbps') or 0:7.1f} GB/s {row.get(f'{p}_gflops') or 0:7.0f} GFLOP/s"
                               for p, _ in paths)
            priced = f"   priced {row['priced_gbps']:7.1f} GB/s" if "priced_gbps" in row else ""
            print(f"{name:9s} rows {m:4d}: {cells}{priced}", flush=True)
        del ws
    copies = copier.gbps() if copier is not None else None
    # the engine's CPU FFN block (norm, fused gate/up, SwiGLU, down), bf16, one token
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=h, intermediate_size=f, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=h, dtype="bfloat16")
    per = 3 * f * h * 2
    count = max(2, int(args.rotate_gib * 2**30 // per))
    blocks = [{"ffn_norm.weight": torch.ones(h, dtype=torch.bfloat16),
               "gate_up.weight": torch.randn(2 * f, h).to(torch.bfloat16),
               "down.weight": torch.randn(h, f).to(torch.bfloat16)} for _ in range(count)]
    x = torch.randn(1, h).to(torch.bfloat16)
    block, taken = {}, {}
    for path, on, pf in [(pf_name(pf), True, pf) for pf in pfs] + [("torch", False, None)]:
        kernels.set_enabled(on)
        if pf is not None:
            kernels.set_prefetch(pf)
        taken.setdefault(path, []).append(round(_rate(lambda i, blocks=blocks: dense.ffn_block(cfg, blocks[i % count], x),
                                                      per, count, args.min_s), 2))
    kernels.set_enabled(True)
    if pf_default is not None:
        kernels.set_prefetch(pf_default)
    for path, rates in taken.items():
        block[f"{path}_gbps"] = round(statistics.median(rates), 2)
        block[f"{path}_ms"] = round(per / block[f"{path}_gbps"] / 1e6, 3)
    print(f"FFN block bf16, 1 token ({per / 1e6:.0f} MB): "
          + "   ".join(f"{p} {block[f'{p}_gbps']:.1f} GB/s ({block[f'{p}_ms']:.2f} ms)" for p in taken), flush=True)
    del blocks
    bw = round(read_bandwidth(min(args.rotate_gib, 2.0)), 1)
    print(f"host memory read (float32 sum): {bw} GB/s", flush=True)
    result = {"command": "python -m engine.bench.cpu_matmul " + " ".join(argv or sys.argv[1:]),
              "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "native": kernels.status()},
              "prefetch_default": pf_default,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "matmul": rows_out, "ffn_block": block, "read_gbps": bw,
              "beside_copies_gbps": copies, "profile_file": args.profile_file}
    if args.out:
        out = Path(args.out) / "cpu_matmul.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
