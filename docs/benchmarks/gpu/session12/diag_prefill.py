"""Diagnosis (session 12): where a prompt's time goes outside its step. One generate of an n-token
prompt (max_new_tokens=1), as the suite's prefill rows run it, after warm-ups of the same length: each
_step_batch (tokens, tier, plan kind, predicted, measured ms), each plan activation (ms), the whole
generate's wall time, and a cProfile of the generate (top functions by cumulative and own time)."""
import cProfile
import io
import pstats
import random
import sys
import time

from engine.bench.gpu_common import open_shape
from engine.units import parse_bytes

shape, budget, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
lengths = [int(s) for s in sys.argv[4].split(",")]
eng = open_shape(shape, parse_bytes(budget), device=sys.argv[5] if len(sys.argv) > 5 else "cuda", layers=layers)
log = []
real_step, real_act = eng._step_batch, eng.executor.activate


def act(plan, *a, **k):
    t = time.perf_counter()
    r = real_act(plan, *a, **k)
    log.append(("activate", plan.tier, plan.kind, round((time.perf_counter() - t) * 1e3, 1)))
    return r


def step(items):
    t = time.perf_counter()
    r = real_step(items)
    p = eng.executor.plan
    log.append(("step", sum(len(it.ids) for it in items), p.tier, p.kind, round(p.predicted_ms, 1),
                round((time.perf_counter() - t) * 1e3, 1)))
    return r


eng._step_batch, eng.executor.activate = step, act


def prompt(n, run):
    rng = random.Random(f"diag:{n}:{run}")
    return "".join(chr(rng.randrange(33, 127)) for _ in range(n))


def one(n, run, prof=None):
    log.clear()
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in eng.generate(prompt(n, run), max_new_tokens=1):
        pass
    if prof:
        prof.disable()
    return (time.perf_counter() - t) * 1e3


for n in lengths:
    for run in (0, 1):
        one(n, run)
        for _ in eng.generate(prompt(64, 50 + run), max_new_tokens=4):    # a decode between, as the suite
            pass
    prof = cProfile.Profile()
    ms = one(n, 9, prof)
    print(f"== {shape} {budget} prompt {n}: generate {ms:.1f} ms, prefill {eng.stats()['prefill_tokens_per_s']:.0f} t/s")
    for e in log:
        print("  ", e)
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(14)
        print("\n".join(ln[:150] for ln in s.getvalue().splitlines()[6:24]))
