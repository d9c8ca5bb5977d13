"""What the OpenMP wait policy does to CPU decode: the bundled model's torch-backend decode with idle
OpenMP threads sleeping (`OMP_WAIT_POLICY=PASSIVE`, the engine's default) and spinning (`ACTIVE`, what
PyTorch's OpenMP runtime does unless told), optionally beside `--busy N` processes that keep N cores busy
(a game, a compile) for the whole run.

    python -m engine.bench.omp_wait [--busy 2] [--tokens 64] [--repeats 2] [--out docs/benchmarks]

The policy is read once when the OpenMP runtime loads, so every run is a fresh process; the policies
alternate, `--repeats` runs each, median kept. Reported: decode tokens/s (first token to last, greedy,
speculation off), and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
from pathlib import Path

from engine.bench.gpu_common import write_report

_CHILD = r"""
import json, time, engine
eng = engine.open_model(None, backend="torch", device="cpu", speculative=False)
list(eng.generate("Hello", max_new_tokens=8))
stamps = []
msgs = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
for ev in eng.generate(msgs, max_new_tokens=%d):
    if ev.token_id is not None:
        stamps.append(time.perf_counter())
eng.close()
print("RESULT " + json.dumps({"tokens": len(stamps), "tps": (len(stamps) - 2) / (stamps[-1] - stamps[1])}))
"""


def _spin(stop) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def run_once(policy: str, tokens: int) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": policy}
    out = subprocess.run([sys.executable, "-c", _CHILD % tokens], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{policy} run failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, default=0, help="processes keeping a core busy each during the runs")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    load = {"start": os.getloadavg()[0]}
    for p in spinners:
        p.start()
    runs: dict[str, list[float]] = {"PASSIVE": [], "ACTIVE": []}
    try:
        for _ in range(args.repeats):
            for policy, rates in runs.items():
                r = run_once(policy, args.tokens)
                rates.append(r["tps"])
                print(f"{policy:8s} {r['tps']:.1f} tokens/s ({r['tokens']} tokens)", flush=True)
    finally:
        stop.set()
        for p in spinners:
            p.join(timeout=5)
    load["end"] = os.getloadavg()[0]
    rows = [{"policy": p, "decode_tps_median": statistics.median(v), "decode_tps_runs": v} for p, v in runs.items()]
    print(f"| OMP_WAIT_POLICY | decode tokens/s (median of {args.repeats}) | runs |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['decode_tps_median']:.1f} | {', '.join(f'{x:.1f}' for x in r['decode_tps_runs'])} |")
    command = " ".join(["python -m engine.bench.omp_wait"] + (argv if argv is not None else sys.argv[1:]))
    path = write_report(Path(args.out), f"omp_wait_busy{args.busy}", {"model": "bundled SmolLM2-135M-Instruct (torch backend, cpu)",
                                                      "busy_processes": args.busy, "tokens": args.tokens,
                                                      "load_average_1m": load, "rows": rows}, command)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
