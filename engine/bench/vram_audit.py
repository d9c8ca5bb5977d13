"""Where a Slipstream process's VRAM goes, phase by phase: NVML's figure for the whole process beside the
PyTorch allocator (live tensors, reserved segments) and the engine's own bookings.

The suite measures one NVML peak per budget; when that peak is above the budget this tells which phase
(prefill 512/4096, decode, batched decode) put it there and whether the bytes were live tensors the
engine did not book (allocated > booked) or allocator segments kept after their tensors died
(reserved > allocated). Also the pinned host memory PyTorch holds beside the weights' size.

    python -m engine.bench.vram_audit --shape llama3-8b --budgets 2GiB,4GiB --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report
from engine.bench.scenarios import BATCHES, PROMPTS, SCENARIOS
from engine.bench.vram_poll import VramPoller
from engine.units import parse_bytes

MIB = 2**20


def _snapshot(eng, poll: VramPoller, phase: str) -> dict:
    torch.cuda.synchronize()
    in_use = eng.plan_report().get("in_use") or {}
    peaks = [s[2].get(os.getpid(), 0) for s in poll.samples]
    return {"phase": phase,
            "nvml_now": poll.per_process().get(os.getpid(), 0),
            "nvml_peak": max(peaks, default=0),
            "allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.memory_reserved(), "max_reserved": torch.cuda.max_memory_reserved(),
            "booked": in_use.get("total"), "booked_peak": in_use.get("peak"),
            "host_pinned": _pinned_bytes(), "weights_bytes": eng.spec.total_weight_bytes}


def _pinned_bytes() -> int | None:
    """Bytes of pinned host blocks PyTorch's host allocator holds (each rounded up to a power of two;
    the engine cuts its weights' buffers from a few chunks), where this PyTorch reports them."""
    try:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current"))
    except (AttributeError, RuntimeError, TypeError):
        return None


def _phases(eng):
    from engine.bench.batch_throughput import run_streams
    from engine.bench.slipstream_runs import DECODE_PROMPT, decode_tps, prefill_tps

    for n in PROMPTS:
        yield f"prefill{n}", (lambda n=n: prefill_tps(eng, n, 1))
    yield "decode", (lambda: decode_tps(eng, 2))
    for b in BATCHES:
        yield f"batch{b}", (lambda b=b: run_streams(eng, b, DECODE_PROMPT, 16, seed=b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budgets", default="2GiB,4GiB")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    from engine.bench.slipstream_runs import _empty_cache, open_engine

    budgets = [(b, parse_bytes(b)) for b in args.budgets.split(",")]
    scen = SCENARIOS[args.shape]
    eng = open_engine(scen, budgets[0][1], "cuda", max(PROMPTS) + 256)
    rows = []
    with VramPoller([os.getpid()], 0.01) as poll:
        for name, b in budgets:
            eng.set_vram_budget(b)
            _empty_cache()
            todo = [("set_budget", lambda: None), *_phases(eng)]
            for phase, fn in todo:
                poll.samples.clear()
                torch.cuda.reset_peak_memory_stats()
                fn()
                row = {"budget": name, "budget_bytes": b, **_snapshot(eng, poll, phase)}
                rows.append(row)
                print(f"{name:>5} {phase:<12} NVML now/peak {row['nvml_now'] / MIB:7.0f}/{row['nvml_peak'] / MIB:7.0f}"
                      f"  alloc now/max {row['allocated'] / MIB:7.0f}/{row['max_allocated'] / MIB:7.0f}"
                      f"  reserved now/max {row['reserved'] / MIB:7.0f}/{row['max_reserved'] / MIB:7.0f}"
                      f"  booked now/peak {(row['booked'] or 0) / MIB:7.0f}/{(row['booked_peak'] or 0) / MIB:7.0f} MiB"
                      f"  pinned host {(row['host_pinned'] or 0) / 2**30:.1f} GiB for {row['weights_bytes'] / 2**30:.1f}"
                      " GiB of weights",
                      flush=True)
    write_report(args.out, "vram_audit", {"shape": args.shape, "rows": rows},
                 "python -m engine.bench.vram_audit " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
