"""Where a decode step's time goes on the GPU machine: a PyTorch profiler trace of a few decode steps
at each budget (kernels, host-to-device copies by memory kind, host-side waits), beside the plan's
prediction and the engine's own counters.

    python -m engine.bench.decode_trace --shape llama3-8b --budgets 2GiB,4GiB [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import open_shape


def _decode(eng, n: int) -> float:
    t0 = time.perf_counter()
    for _ in eng.generate("x" * 48, max_new_tokens=n):
        pass
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budgets", default="2GiB,4GiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    budgets = args.budgets.split(",")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    eng = open_shape(args.shape, budgets[0], device=args.device, n_ctx=1024)
    report = {}
    for b in budgets:
        eng.set_vram_budget(b)
        _decode(eng, 8)                                          # warm-up
        s0 = eng.stats()["streamed_bytes"]
        t = _decode(eng, 17)
        copied = (eng.stats()["streamed_bytes"] - s0) / 17
        tier1 = eng.plan_report()["tiers"][0]
        print(f"== {b}: decode {eng.stats()['decode_tokens_per_s']:.2f} tok/s ({t:.2f} s for 17), predicted "
              f"{tier1['predicted_ms']:.1f} ms/step, plan {tier1['plan']}, copied {copied / 1e9:.2f} GB/token",
              flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU]
        if args.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        eng.executor.label_sublayers = True
        with torch.profiler.profile(activities=acts) as prof:
            _decode(eng, args.steps)
        eng.executor.label_sublayers = False
        table = prof.key_averages().table(sort_by="self_cpu_time_total" if args.device != "cuda"
                                          else "cuda_time_total", row_limit=25)
        print(table, flush=True)
        memcpy = {}
        for ev in prof.events():
            if "Memcpy" in ev.name or "memcpy" in ev.name.lower():
                d = memcpy.setdefault(ev.name, [0, 0.0])
                d[0] += 1
                d[1] += getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        for k, (n, us) in sorted(memcpy.items(), key=lambda kv: -kv[1][1])[:8]:
            print(f"  {k:60s} n={n:5d} device {us / 1e3:8.1f} ms", flush=True)
        report[b] = {"decode_tps": eng.stats()["decode_tokens_per_s"], "predicted_ms": tier1["predicted_ms"],
                     "plan": tier1["plan"], "copied_per_token": copied, "table": table,
                     "memcpy": {k: v for k, v in memcpy.items()}}
        if args.out:
            raw = Path(args.out) / f"decode_trace_{b}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb", compresslevel=6) as g:
                shutil.copyfileobj(f, g)
            raw.unlink()
    eng.close()
    if args.out:
        (Path(args.out) / "decode_trace.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
