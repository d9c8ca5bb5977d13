"""Pairs of Slipstream and llama.cpp rows measured on one lease, for the suite's comparisons without a lease
between them.

The suite's llama.cpp rows are measured once (every llama-bench run reloads the model, and the build takes
minutes), its Slipstream rows again after each change, so a ratio in `results.md` usually spans two leases;
leases of the H200 kind have differed by up to 1.5x in CPU rate (`results.md`, Leases). A pair is the two
systems' rows of one model and budget from one lease (one device call, or calls on a lease the device tool
reported still held between them), kept in `gpu/issue6/same-lease.json`; the merge sets them side by side and
judges the decode target on each pair too.

    python -m engine.bench.same_lease --into docs/benchmarks/gpu/issue6/same-lease.json \\
        --slipstream S/part-slipstream.json --llamacpp L/part-llamacpp.json --call "session 18, calls F and G"
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from engine.bench.gpu_merge import best_llamacpp
from engine.bench.partials import now_iso

KEEP = ("system", "model", "budget", "budget_bytes", "peak_vram_bytes", "fits", "prefill512_tps", "prefill4096_tps",
        "decode_tps", "decode_tps_runs", "plan", "allowance_bytes", "note")
# Two parts' lease probes further apart than this cannot be one device call's (a call is at most 10 minutes;
# calls on one held lease follow within a few more)
MAX_APART_S = 1800


def _probe_times(part: dict) -> list[datetime]:
    return [datetime.fromisoformat(p["at"]) for p in part.get("meta", {}).get("lease_probes") or [] if p.get("at")]


def pair(slipstream: dict, llamacpp: dict, call: str) -> list[dict]:
    """The pairs (one per model and budget both parts have) of a Slipstream and a llama.cpp part file of one
    lease; raises ValueError where they share none or their lease probes are too far apart for one lease."""
    times = _probe_times(slipstream) + _probe_times(llamacpp)
    if not times:
        raise ValueError("neither part recorded a lease probe: no way to tell they ran on one lease")
    apart = (max(times) - min(times)).total_seconds()
    if apart > MAX_APART_S:
        raise ValueError(f"the parts' lease probes are {apart:.0f} s apart: more than one lease's {MAX_APART_S} s")
    out = []
    for ss in slipstream.get("rows", []):
        if ss.get("system") != "slipstream" or ss.get("pending"):
            continue
        peers = [r for r in llamacpp.get("rows", []) if r.get("system", "").startswith("llama.cpp")
                 and (r.get("model"), r.get("budget")) == (ss.get("model"), ss.get("budget"))]
        if not peers:
            continue
        out.append({"call": call, "model": ss["model"], "budget": ss["budget"], "added": now_iso(),
                    "lease_probes": {"slipstream": slipstream["meta"].get("lease_probes"),
                                     "llama.cpp": llamacpp["meta"].get("lease_probes")},
                    "rate_probes": ss.get("lease_rates"),
                    "rows": [{k: r.get(k) for k in KEEP if k in r} for r in [ss, *peers]]})
    if not out:
        raise ValueError("the parts share no model and budget with a Slipstream and a llama.cpp row")
    return out


def slipstream_row(p: dict) -> dict:
    return next(r for r in p["rows"] if r["system"] == "slipstream")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.same_lease", description=__doc__.splitlines()[0])
    ap.add_argument("--into", type=Path, required=True, help="the pairs file (created if missing)")
    ap.add_argument("--slipstream", type=Path, required=True, help="a Slipstream part file of the lease")
    ap.add_argument("--llamacpp", type=Path, required=True, help="a llama.cpp part file of the same lease")
    ap.add_argument("--call", required=True, help="which call(s), and how they are known to share the lease")
    args = ap.parse_args(argv)
    try:
        new = pair(json.loads(args.slipstream.read_text()), json.loads(args.llamacpp.read_text()), args.call)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"same_lease: {exc}") from exc
    data = json.loads(args.into.read_text()) if args.into.is_file() else {"pairs": []}
    data["pairs"].extend(new)
    args.into.write_text(json.dumps(data, indent=1) + "\n")
    for p in new:
        ss, best = slipstream_row(p), best_llamacpp(p["rows"], "decode_tps")
        ratio = ss["decode_tps"] / best["decode_tps"] if best else float("nan")
        print(f"{p['model']} {p['budget']}: Slipstream decode {ss['decode_tps']:.2f} t/s, best llama.cpp "
              f"{best['decode_tps'] if best else float('nan'):.2f} ({best['system'] if best else '-'}): {ratio:.2f}x")
    print(f"wrote {args.into} ({len(data['pairs'])} pairs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
