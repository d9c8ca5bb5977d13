"""Where the host's time goes in a decode trace written by `engine.bench.decode_trace` (its gzipped chrome
trace with one profiler range per sub-layer, named `<sub-layer>:<placement>`).

    python -m engine.bench.trace_breakdown docs/benchmarks/gpu/decode_trace_4GiB.json.gz [--top 10]

Per kind of sub-layer and placement (e.g. `cpu/ffn`, `resident/attn`): how many ran, their mean wall time
on the host thread that ran the step, and how much of it was outside any PyTorch op (the native CPU matmul,
waits and Python), how many top-level PyTorch ops and CUDA kernel launches each issued (what the
estimator's per-op host cost should count), then the PyTorch ops taking the rest. A CPU sub-layer's time outside PyTorch ops is
mostly the native matmul: divided into its weight bytes it gives the rate the CPU really streamed at during
decode, to set beside the profile's rate for the same matmuls. Also the step's copies and their rates,
and how busy the copy engine, the CPU sub-layers and the GPU's kernels were over the traced steps.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import sys


def kind_of(label: str) -> str:
    """`layers.3.ffn:cpu` -> `cpu/ffn`; `head:resident` -> `resident/head`."""
    name, place = label.rsplit(":", 1)
    return f"{place}/{name.split('.')[-1] if name.startswith('layers.') else name}"


def breakdown(events: list[dict]) -> dict:
    spans = [e for e in events if e.get("ph") == "X"]
    labels = [e for e in spans if e.get("cat") == "user_annotation" and ":" in e.get("name", "")]
    if not labels:
        raise SystemExit("no sub-layer ranges in this trace (was it written by engine.bench.decode_trace?)")
    tid = labels[0]["tid"]
    ops = sorted((e for e in spans if e.get("cat") == "cpu_op" and e.get("tid") == tid), key=lambda e: e["ts"])
    starts = [o["ts"] for o in ops]
    launches = sorted(e["ts"] for e in spans
                      if e.get("cat") == "cuda_runtime" and e.get("tid") == tid and "LaunchKernel" in e.get("name", ""))
    kinds: dict[str, dict] = {}
    for lab in labels:
        k = kinds.setdefault(kind_of(lab["name"]), {"n": 0, "us": 0.0, "outside_us": 0.0, "launches": 0,
                                                     "ops": collections.Counter(), "calls": collections.Counter()})
        a, b = lab["ts"], lab["ts"] + lab["dur"]
        k["launches"] += bisect.bisect_left(launches, b) - bisect.bisect_left(launches, a)
        i, end, inside = bisect.bisect_left(starts, a), a, 0.0
        while i < len(ops) and ops[i]["ts"] < b:
            o = ops[i]
            if o["ts"] >= end:                       # top-level ops only (not those nested in the last one)
                k["ops"][o["name"]] += o["dur"]
                k["calls"][o["name"]] += 1
                inside += o["dur"]
                end = o["ts"] + o["dur"]
            i += 1
        k["n"] += 1
        k["us"] += lab["dur"]
        k["outside_us"] += lab["dur"] - inside
    copies = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for e in spans:
        if e.get("name", "").startswith("Memcpy"):
            c = copies[e["name"]]
            c[0] += 1
            c[1] += e["dur"]
            c[2] += float((e.get("args") or {}).get("bytes", 0) or 0)
    return {"kinds": kinds, "copies": dict(copies), "busy": busy_fractions(spans, labels)}


def _union(intervals) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _overlap(xs, ys) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, b - a)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_fractions(spans: list[dict], labels: list[dict]) -> dict[str, float]:
    """Over the traced steps (first sub-layer's start to the last one's end): the share of time the copy
    engine copied weights, the host ran CPU sub-layers, both at once, GPU kernels ran, and none of them."""
    t0 = min(e["ts"] for e in labels)
    t1 = max(e["ts"] + e["dur"] for e in labels)
    clip = [(max(a, t0), min(b, t1)) for a, b in
            ((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("name", "").startswith("Memcpy HtoD (Pinned"))
            if b > t0 and a < t1]
    dma = _union(clip)
    cpu = _union((e["ts"], e["ts"] + e["dur"]) for e in labels if e["name"].endswith(":cpu"))
    gpu = _union((e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") == "kernel")
    span = t1 - t0
    return {"span_ms": span / 1e3, "copies": _length(dma) / span, "cpu_sublayers": _length(cpu) / span,
            "copies_and_cpu": _overlap(dma, cpu) / span, "gpu_kernels": _length(gpu) / span,
            "none": 1 - _length(_union(dma + cpu + gpu)) / span}


def print_report(r: dict, top: int = 8) -> None:
    print("| sub-layers | count | mean ms | outside PyTorch ops ms | PyTorch ops / kernel launches each "
          "| top PyTorch ops (us per sub-layer) |")
    print("|---|---|---|---|---|---|")
    for name, k in sorted(r["kinds"].items()):
        n = k["n"]
        ops = ", ".join(f"{op.replace('aten::', '')} {us / n:.0f}" for op, us in k["ops"].most_common(top))
        counts = f"{sum(k['calls'].values()) / n:.0f} / {k['launches'] / n:.0f}"
        print(f"| {name} | {n} | {k['us'] / n / 1e3:.2f} | {k['outside_us'] / n / 1e3:.2f} | {counts} | {ops} |")
    b = r["busy"]
    print()
    print(f"Over {b['span_ms']:.0f} ms of traced steps: weight copies {b['copies']:.0%}, CPU sub-layers "
          f"{b['cpu_sublayers']:.0%}, both at once {b['copies_and_cpu']:.0%}, GPU kernels {b['gpu_kernels']:.0%}, "
          f"none of these {b['none']:.0%}.")
    print()
    print("| copy | count | total ms | GB/s |")
    print("|---|---|---|---|")
    for name, (n, us, nbytes) in sorted(r["copies"].items(), key=lambda kv: -kv[1][1]):
        rate = f"{nbytes / us / 1e3:.1f}" if nbytes and us else "-"
        print(f"| {name} | {n} | {us / 1e3:.1f} | {rate} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a decode_trace_<budget>.json.gz")
    ap.add_argument("--top", type=int, default=8, help="PyTorch ops listed per kind")
    args = ap.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    print_report(breakdown(events), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
