"""Decode on the CPU alone (the torch backend, device "cpu"), a named shape with random weights cut to a few
layers, the runs taking turns at the native matmuls' prefetch distances (`kernels.set_prefetch`): what the
distance does to whole decode steps, not only to one matmul (`engine.bench.cpu_matmul --prefetch`).

    python -m engine.bench.cpu_decode --shape llama3-8b --layers 6 --prefetch 0,512 --turns 10 --tokens 40 --out DIR

Each turn decodes `--tokens` tokens greedily after a short prompt; a turn's rate is the inverse of its median
token interval. The distances take turns in abba order; a distance given as `torch` is a turn with the native
path off (`kernels.set_enabled(False)`: PyTorch's matmuls and attention), the engine's path where the
library is missing or declines. Prints a table; writes DIR/cpu_decode.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=6, help="layers kept (the head and embedding stay whole)")
    ap.add_argument("--prefetch", default="0,512",
                    help="comma-separated distances in elements (0: off), or torch (the native path off)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    try:
        pfs = [v if v == "torch" else int(v) for v in a.prefetch.split(",") if v]
    except ValueError:
        pfs = []
    if not pfs or any(v != "torch" and v < 0 for v in pfs) or a.layers < 1 or a.turns < 1 or a.tokens < 3:
        ap.error("expected distances of at least 0 or torch, --layers, --turns at least 1 and --tokens at least 3")
    import torch

    from engine import kernels
    from engine.bench.decode_runs import turn_of
    from engine.bench.gpu_common import machine_info
    from engine.bench.scenarios import Scenario
    from engine.bench.slipstream_runs import open_engine

    status, before = kernels.status(wait=True), kernels.prefetch()
    if before is None:
        print(f"no native kernel here, nothing to take turns at: {status}")
        return 1
    eng = open_engine(Scenario(a.shape, "dense", a.shape, layers=a.layers), 0, "cpu", 512)

    def run(seed: int, n: int) -> float:
        gaps, last = [], None
        for _ in eng.generate(f"Once upon a time {seed}", max_new_tokens=n, seed=seed, temperature=0):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        return 1 / statistics.median(gaps)

    turn = turn_of("abba")
    try:
        run(0, 8)                                       # (warm-up)
        rows = []
        for i in range(a.turns):
            pf = pfs[turn(i, len(pfs))]
            kernels.set_enabled(pf != "torch")
            if pf != "torch":
                kernels.set_prefetch(pf)
            rows.append({"turn": i, "prefetch": pf if pf == "torch" else kernels.prefetch(),
                         "tps": round(run(i + 1, a.tokens), 2)})
    finally:
        eng.close()
        kernels.set_enabled(True)
        kernels.set_prefetch(before)
    summary = {pf: statistics.median([r["tps"] for r in rows if r["prefetch"] == pf]) for pf in dict.fromkeys(pfs)}
    print(f"{a.shape}, {a.layers} layers, {torch.get_num_threads()} threads; {status}")
    print("| prefetch | turns, t/s | median t/s |\n|---:|---|---:|")
    for pf, med in summary.items():
        print(f"| {pf} | {', '.join(str(r['tps']) for r in rows if r['prefetch'] == pf)} | {med:.2f} |")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "cpu_decode.json"
    path.write_text(json.dumps({
        "command": "python -m engine.bench.cpu_decode " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(),
        "cpu_matmul": status, "threads": torch.get_num_threads(), "shape": a.shape, "layers": a.layers,
        "tokens": a.tokens, "rows": rows, "median_tps": {str(k): v for k, v in summary.items()}}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
