"""Where a prompt's time to first token goes, as the suite measures it: the engine set up as
`slipstream_runs.measure_budget` sets it up (warm-ups at each prompt length and a short decode), then a few
fresh prompts of each length, each with a host timeline from the call to `generate` to its first token:
every plan activation (`Executor.activate`: weights admitted or evicted, slots, KV placement), every
step (`Executor.forward_batch` / `forward`: its tokens, its host time; the GPU's work queued by one step
shows as time in the next blocking call) and the budget re-plans applied meanwhile. For a suite row far
slower than one step of its plan timed alone (`engine.bench.planner_accuracy`): session 24's call BF timed
the Llama-3-8B 8 GiB tier-4096 step at 156 ms, where the suite's 4096-token prefill reads 287 ms.

    python -m engine.bench.prefill_timeline --shape llama3-8b --budgets 4GiB,8GiB --out DIR
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from engine.bench.gpu_common import write_report
from engine.units import parse_bytes

WATCHED = (("executor", "activate"), ("executor", "forward_batch"), ("executor", "forward"),
           ("engine", "_apply_pending_budget"), ("engine", "_make_planset"), ("accel", "release_to_driver"),
           ("accel", "synchronize"), ("executor", "_drain_slots"), ("store", "evict"), ("store", "set_resident"),
           ("store", "set_slots"), ("store", "drop_slots"), ("kv", "_resize"), ("kv", "shrink"), ("kv", "_grow"),
           ("kv", "_spill"), ("kv", "_copy"), ("kv", "ready"), ("kv", "restore"), ("kvhost", "_add_chunk"))
SHOWN_MS = 1.0      # spans shorter than this are summed per kind, not listed


class Timeline:
    """Host-time spans of the watched methods, relative to `start()`."""

    def __init__(self, eng):
        self.spans: list[dict] = []
        self.t0 = time.perf_counter()
        self._undo = []
        ex = eng.executor
        owners = {"executor": ex, "engine": eng, "accel": eng.accel, "store": getattr(ex, "store", None),
                  "kv": getattr(ex, "kv", None), "kvhost": getattr(getattr(ex, "kv", None), "host", None)}
        for owner, name in WATCHED:
            obj = owners[owner]
            fn = getattr(obj, name, None) if obj is not None else None
            if fn is None:
                continue
            setattr(obj, name, self._wrap(f"{owner}.{name}", fn))
            self._undo.append((obj, name))

    def _wrap(self, label: str, fn):
        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append({"what": label, "start_ms": (t - self.t0) * 1e3,
                                   "ms": (time.perf_counter() - t) * 1e3, "info": _info(label, args)})
        return run

    def start(self) -> None:
        self.spans, self.t0 = [], time.perf_counter()

    def close(self) -> None:
        for obj, name in self._undo:
            try:
                delattr(obj, name)           # (the instance attribute hid the class's method)
            except AttributeError:
                pass


def _info(label: str, args) -> str:
    if label.endswith("activate") and args:
        p = args[0]
        return f"tier {getattr(p, 'tier', '?')} {getattr(p, 'kind', '?')}"
    if label.endswith("forward_batch") and args:
        return "tokens " + "+".join(str(len(getattr(it, "ids", ()) or ())) for it in args[0])
    if label.endswith(".forward") and len(args) > 1:
        return f"tokens {len(args[1])}"
    if label.endswith("._copy") and len(args) > 1:
        return f"{len(args[0])} blocks {'to the host tier' if args[1] else 'back'}"
    if label.endswith("._add_chunk"):
        return f"(thread {threading.current_thread().name})"
    return ""


def _lines(spans: list[dict]) -> list[str]:
    """The spans in order of their start (nested ones after their parent), those under SHOWN_MS summed per
    kind at the end."""
    out, small = [], {}
    for s in sorted(spans, key=lambda s: (s["start_ms"], -s["ms"])):
        if s["ms"] >= SHOWN_MS:
            out.append(f"    {s['start_ms']:8.1f} +{s['ms']:7.1f} ms  {s['what']} {s['info']}")
        else:
            n, ms = small.get(s["what"], (0, 0.0))
            small[s["what"]] = (n + 1, ms + s["ms"])
    if small:
        out.append("    under 1 ms: " + ", ".join(f"{k} x{n} {ms:.1f} ms" for k, (n, ms) in small.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.prefill_timeline", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--budgets", default="4GiB,8GiB")
    ap.add_argument("--device", default="cuda", help="cuda, or sim (a dry run)")
    ap.add_argument("--runs", type=int, default=2, help="timed prompts of each length per budget")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)

    from engine.bench.scenarios import DRY_SCENARIOS, PROMPTS, SCENARIOS
    from engine.bench.slipstream_runs import _empty_cache, decode_tps, open_engine, prefill_tps, suite_n_ctx

    budgets = [(b, parse_bytes(b)) for b in args.budgets.split(",") if b]
    eng = open_engine({**SCENARIOS, **DRY_SCENARIOS}[args.shape], budgets[0][1], args.device, suite_n_ctx())
    rows = []
    try:
        for name, budget in budgets:
            eng.set_vram_budget(budget)
            _empty_cache()
            salt = f"b{budget}"
            for n in PROMPTS:                            # the suite's warm-ups
                prefill_tps(eng, n, 25, salt)
            decode_tps(eng, 24, 4, salt=salt)
            tl = Timeline(eng)
            try:
                for n in PROMPTS:
                    for r in range(args.runs):
                        tl.start()
                        tps = prefill_tps(eng, n, r, salt)
                        ttft = n / tps * 1e3
                        rows.append({"budget": name, "tokens": n, "run": r, "prefill_tps": tps, "ttft_ms": ttft,
                                     "step_tokens": eng.planset.step_tokens, "spans": tl.spans})
                        print(f"{name} {n} tokens run {r}: {tps:.0f} t/s, time to first token {ttft:.1f} ms "
                              f"(steps of {eng.planset.step_tokens})", flush=True)
                        for line in _lines(tl.spans):
                            print(line, flush=True)
            finally:
                tl.close()
    finally:
        eng.close()
    path = write_report(args.out, "prefill_timeline", {"shape": args.shape, "device": args.device, "rows": rows},
                        "python -m engine.bench.prefill_timeline " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
