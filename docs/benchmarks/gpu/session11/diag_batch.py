"""Diagnosis (session 11): where a batched decode step's time goes. Per step: tokens, tier, plan kind,
predicted ms, measured ms, whether a plan was activated; and a cProfile of the engine thread's steps."""
import cProfile
import io
import pstats
import sys
import time

from engine.bench.batch_throughput import run_streams
from engine.bench.gpu_common import open_shape
from engine.units import parse_bytes

shape, budget, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
streams = [int(s) for s in sys.argv[4].split(",")]
dev = sys.argv[5] if len(sys.argv) > 5 else "cuda"
eng = open_shape(shape, parse_bytes(budget), device=dev, layers=layers, n_ctx=512)
eng._ensure_kv_capacity(max(streams) * 160)
log = []
prof = cProfile.Profile()
real_step, real_act = eng._step_batch, eng.executor.activate
acts = [0]


def act(plan, *a, **k):
    t = time.perf_counter()
    r = real_act(plan, *a, **k)
    acts[0] += 1
    log.append(("activate", plan.tier, plan.kind, round((time.perf_counter() - t) * 1e3, 1)))
    return r


def step(items):
    n = sum(len(it.ids) for it in items)
    t = time.perf_counter()
    prof.enable()
    try:
        return real_step(items)
    finally:
        prof.disable()
        p = eng.executor.plan
        log.append(("step", len(items), n, p.tier, p.kind, round(p.predicted_ms, 1),
                    round((time.perf_counter() - t) * 1e3, 1)))


eng._step_batch, eng.executor.activate = step, act
run_streams(eng, max(streams), 64, 4, seed=97)
for b in streams:
    log.clear()
    prof = cProfile.Profile()
    r = run_streams(eng, b, 64, 32, seed=b)
    print(f"== {shape} {budget} streams {b}: decode agg {r['decode_aggregate_tokens_per_s']:.1f} t/s, "
          f"wall {r['aggregate_tokens_per_s']:.1f}, steps {r['steps']}, plan {r['decode_plan']}")
    steps = [e for e in log if e[0] == "step"]
    for e in log[:6] + [("...",)] + log[-3:]:
        print("  ", e)
    dec = [e[6] for e in steps if e[2] == b]
    if dec:
        dec.sort()
        print(f"   decode steps: {len(dec)}, median {dec[len(dec) // 2]} ms, min {dec[0]}, max {dec[-1]}; "
              f"activations {sum(1 for e in log if e[0] == 'activate')}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print("\n".join(s.getvalue().splitlines()[6:34]))
eng.close()
