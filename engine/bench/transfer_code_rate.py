"""What transfer coding buys on this machine: a streamed sub-layer's raw bytes delivered into VRAM per second,
with plain copies against coded copies (copy engine + GPU decode through the staging ring), plus the host's
encode rate and the GPU's decode rate alone.

    python -m engine.bench.transfer_code_rate --mib 448 --reps 10 --out DIR [--tight]

The buffer is normal bf16 at the scale of a Llama-3-8B FFN's weights (random: a trained model's exponents
spread about as a normal distribution's do). Prints a table; writes DIR/transfer_code_rate.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from engine.bench.gpu_common import machine_info
from engine.sharding import transfer_code as tc


def _time(fn, reps: int, sync) -> list[float]:
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=448, help="raw MiB of the buffer (a Llama-3-8B FFN: 336)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--device", choices=("cuda", "sim"), default="cuda",
                    help="sim: the same steps on the CPU (a dry run of the script; its rates say nothing)")
    ap.add_argument("--tight", action="store_true",
                    help="chunks in the tight form where it is smaller (SLIPSTREAM_TRANSFER_CODE_TIGHT)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    from engine.sharding.device import Accelerator
    from engine.sharding.weights import Stages

    cuda = a.device == "cuda"
    dev = "cuda" if cuda else "cpu"
    words = a.mib << 19
    raw_t = (torch.randn(words, device=dev) * a.scale).to(torch.bfloat16).cpu()
    raw = torch.empty(2 * words, dtype=torch.uint8, pin_memory=cuda)
    raw.copy_(raw_t.view(torch.uint8))
    del raw_t
    t0 = time.perf_counter()
    coded = tc.encode(raw, pin=cuda, tight=a.tight)
    encode_s = time.perf_counter() - t0
    if a.tight and cuda:
        tc._check_tight_triton(torch.device("cuda"))          # (the fused decode where it passes its check)
    accel = Accelerator(a.device)
    dst = torch.empty(2 * words, dtype=torch.uint8, device=dev)
    stages = Stages([torch.empty(coded.stage_bytes, dtype=torch.uint8, device=dev) for _ in range(tc.N_STAGES)])
    sync = torch.cuda.synchronize if cuda else accel.synchronize

    def plain():
        accel.copy_async(dst, raw).wait_host()

    def coded_copy():
        accel.copy_coded(dst, coded, stages).wait_host()

    in_vram = tc.CodedBuffer(coded.host.to(dev), coded.chunks, coded.raw_bytes, coded.esc_off, coded.escapes)

    def decode_only():          # (each piece also copied VRAM -> stage, as decode() does)
        tc.decode(in_vram, dst)

    coded_copy()
    sync()
    exact = torch.equal(dst.cpu(), raw)
    rows = {}
    for name, fn in (("plain copy", plain), ("coded copy", coded_copy), ("GPU decode alone", decode_only)):
        fn()
        ts = sorted(_time(fn, a.reps, sync))
        med = ts[len(ts) // 2]
        rows[name] = {"median_ms": round(med * 1e3, 3), "raw_gbps": round(2 * words / med / 1e9, 2),
                      "runs_ms": [round(t * 1e3, 3) for t in ts]}
    # host time to issue one copy (what the step's thread spends before it goes on), the GPU idle
    for name, issue in (("plain copy", lambda: accel.copy_async(dst, raw)),
                        ("coded copy", lambda: accel.copy_coded(dst, coded, stages))):
        us = []
        for _ in range(a.reps):
            sync()
            t0 = time.perf_counter()
            h = issue()
            us.append((time.perf_counter() - t0) * 1e6)
            h.wait_host()
        rows[name]["issue_us"] = round(sorted(us)[len(us) // 2], 1)
    result = {"command": "python -m engine.bench.transfer_code_rate " + " ".join(argv or sys.argv[1:]),
              "device": a.device,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(), "raw_bytes": 2 * words, "coded_bytes": coded.nbytes,
              "ratio": round(coded.nbytes / (2 * words), 4), "chunks": len(coded.chunks),
              "escapes": coded.escapes, "encode_s": round(encode_s, 3),
              "encode_gbps": round(2 * words / encode_s / 1e9, 2), "exact": exact,
              "triton": tc.triton_available(), "tight": a.tight,
              "tight_chunks": sum(c.tight for c in coded.chunks), "tight_triton": tc._tight_triton is not None,
              "rows": rows}
    print(f"{a.mib} MiB bf16 (scale {a.scale}): coded {result['ratio']:.4f} of the bytes, {result['escapes']} escapes, "
          f"exact {exact}; host encode {result['encode_gbps']} GB/s; Triton {result['triton']}"
          + (f"; tight chunks {result['tight_chunks']} of {len(coded.chunks)}, fused tight decode "
             f"{result['tight_triton']}" if a.tight else ""))
    print("| copy | median ms | raw GB/s delivered | host us to issue |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['median_ms']} | {r['raw_gbps']} | {r.get('issue_us', '-')} |")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "transfer_code_rate.json").write_text(json.dumps(result, indent=1))
    accel.close()
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
