"""Host time around the CPU experts of a mixture-of-experts decode step, by component.

    python -m engine.bench.moe_host_overhead --layers 3                  # sim: any machine, ~10 GB RAM
    python -m engine.bench.moe_host_overhead --layers 3 --device cuda    # the GPU machine
    python -m engine.bench.moe_host_overhead --layers 24 --device cuda --plan planner --budget 2GiB --n-ctx 4096

The Qwen3-30B-A3B shape at full width with `--layers` layers (random bf16 weights), under the static
plan the GPU machine runs: attention, routers and head resident, embedding and every routed expert group
on the CPU (`--plan planner`: the planner's own plan at `--budget` instead, where whole MoE layers run on
the CPU as one call and the GPU attentions between them from the host; its probes cover that path's pieces
too). Greedy decode of `--steps` tokens after a short prompt, after a warm-up. Two passes:

1. Timed: perf_counter probes around the functions of the MoE path (router, expert blocks, their native
   glue, the native kernel call itself, adding expert outputs, the state's transfers, the executor's
   per-sub-layer lookups and hook), each measured exclusive of the probes inside it; what the step spends
   outside every probe is the executor's loop and step setup. Per component: the median over steps of
   microseconds per MoE layer. "native kernel" is the C call of `linear_many` (the expert matmuls); the
   rest of the MoE rows is host overhead.
2. Profiled (`--profile`): the executor's `label_sublayers` ranges under torch.profiler: host time per
   sub-layer kind and the PyTorch ops each MoE layer dispatches (the profiler adds a few microseconds
   per op, so these times run higher than the first pass's).

On "sim" the attention and router run on the CPU too (their rows then include real compute) and the
state never changes device; on cuda the router's host wait and the transfers show. Writes a table and
docs/benchmarks/moe_host_overhead[_<device>].json (command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report

PROMPT = "x" * 16
COMPONENT_ORDER = ("router", "router norm+matmul", "state transfer", "experts: torch ops", "experts: native glue",
                   "kernel call (python)", "native kernel", "add expert outputs", "finish", "executor MoE glue",
                   "MoE layer on the CPU (one call)", "weights lookup", "move", "wait for the GPU",
                   "between_sublayers hook", "attention", "attention from the host: glue",
                   "attention from the host: index inputs", "graph: rope buffers", "graph: key",
                   "graph: run_host (copies)", "graph: replay launch", "embed", "head", "loop + step setup")
MOE_COMPONENTS = ("router", "router norm+matmul", "state transfer", "experts: torch ops", "experts: native glue",
                  "kernel call (python)", "add expert outputs", "finish", "executor MoE glue",
                  "MoE layer on the CPU (one call)")
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


class Probes:
    """perf_counter accumulators around functions, each exclusive of the probes it calls."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []
        self._undo: list = []

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:          # (an older tree without this function)
            return
        stack, total, calls, clock = self._stack, self.total, self.calls, self.clock

        def probed(*a, **k):
            t0 = clock()
            stack.append(0.0)
            try:
                return fn(*a, **k)
            finally:
                dt = clock() - t0
                total[label] += dt - stack.pop()
                calls[label] += 1
                if stack:
                    stack[-1] += dt

        self._undo.append((owner, attr, vars(owner).get(attr, _MISSING)))
        setattr(owner, attr, probed)

    def restore(self) -> None:
        for owner, attr, own in reversed(self._undo):
            if own is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)
        self._undo.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


_MISSING = object()


def static_plan(eng):
    """Attention, routers, dense FFNs and head resident; embedding and expert groups on the CPU (on a
    plain "cpu" engine everything is on the CPU)."""
    from engine.sharding.plan import Placement, Plan, PlanSet

    if eng.accel is None:
        return
    placement = {s.name: Placement.CPU if s.kind in ("experts", "embed") else Placement.RESIDENT
                 for s in eng.spec.sublayers}
    planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), 0) for t in eng.tiers])
    eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
    eng.set_vram_budget(eng.budget)


def open_engine(layers: int, device: str, budget: str, plan: str = "static", n_ctx: int = 512):
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=layers)
    loaded = random_model(cfg, seed=0, name=f"qwen3-30b-a3b-{layers}l")
    eng = TorchEngine(loaded, device=device, vram_budget=None if device == "cpu" else budget, n_ctx=n_ctx,
                      speculative=False, tiers=(1, 16))
    del loaded
    if plan == "static":
        static_plan(eng)
    return eng


def decode(eng, n: int) -> list[int]:
    return [e.token_id for e in eng.generate(PROMPT, max_new_tokens=n) if e.token_id is not None]


def plain_pass(eng, steps: int, clock) -> list[float]:
    """Decode step times (s) with no probes: the end-to-end figure the probes' own cost cannot bias."""
    ex = eng.executor
    times: list[float] = []
    real_forward = ex.forward_batch

    def forward_batch(items):
        t0 = clock()
        out = real_forward(items)
        times.append(clock() - t0)
        return out

    ex.forward_batch = forward_batch
    try:
        decode(eng, steps + 1)
    finally:
        del ex.forward_batch
    return times[1:]                                  # the first is the prompt's prefill


def timed_pass(eng, steps: int, clock) -> tuple[dict, list[int]]:
    """Per component: median over decode steps of µs per MoE layer (and per step), from the probes."""
    from engine import kernels
    from engine.models import dense, moe

    ex = eng.executor
    probes = Probes(clock)
    lib = kernels._load()
    # (owner, function, component); functions an older tree lacks are skipped
    table = [(moe, "router_block", "router"), (moe, "linear", "router norm+matmul"),
             (moe, "rms_norm", "router norm+matmul"), (moe.MoeState, "to", "state transfer"),
             (moe, "packed_move", "state transfer"), (moe, "experts_blocks", "experts: torch ops"),
             (moe, "_experts_native", "experts: native glue"), (moe, "_experts_decode", "experts: native glue"),
             (moe, "_add_expert", "add expert outputs"), (kernels, "weighted_sum", "add expert outputs"),
             (moe, "finish", "finish"), (kernels, "linear_many", "kernel call (python)"),
             (kernels, "linear_stacked", "kernel call (python)"), (lib, "sl_linear_batch", "native kernel"),
             (ex, "_moe_step", "executor MoE glue"), (ex, "_cpu_groups", "executor MoE glue"),
             (ex, "_weights", "weights lookup"), (ex, "_move", "move"), (ex, "_wait_gpu", "wait for the GPU"),
             (eng.accel, "wait_event_host", "wait for the GPU"), (ex, "_attention", "attention"),
             (ex, "_head", "head"), (dense, "embed_tokens", "embed"),
             (ex, "between_sublayers", "between_sublayers hook"),
             (ex, "_moe_layer_on_cpu", "MoE layer on the CPU (one call)"),
             (ex, "_attention_from_host", "attention from the host: glue"),
             (ex, "_captured_inputs", "attention from the host: index inputs"),
             (ex.graphs, "rope", "graph: rope buffers"), (ex.graphs, "_key", "graph: key"),
             (ex.graphs, "run_host", "graph: run_host (copies)"),
             (torch.cuda.CUDAGraph, "replay", "graph: replay launch")]
    for owner, attr, label in table:
        if owner is not None and getattr(owner, attr, None) is not None:
            probes.wrap(owner, attr, label)
    per_step: list[dict[str, float]] = []
    real_forward = ex.forward_batch

    def forward_batch(items):
        before = probes.snapshot()
        t0 = clock()
        out = real_forward(items)
        wall = clock() - t0
        after = probes.snapshot()
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        d["loop + step setup"] = wall - sum(d.values())
        d["step"] = wall
        per_step.append(d)
        return out

    ex.forward_batch = forward_batch
    try:
        per_step.clear()
        calls0 = dict(probes.calls)
        tokens = decode(eng, steps + 1)
    finally:
        del ex.forward_batch
        probes.restore()
    decode_steps = per_step[1:]                      # the first is the prompt's prefill
    n_moe = sum(eng.config.is_moe_layer(i) for i in range(eng.config.num_layers))
    keys = [k for k in COMPONENT_ORDER if any(k in s for s in decode_steps)]
    med = {k: statistics.median(s.get(k, 0.0) for s in decode_steps) * 1e6 for k in keys + ["step"]}
    moe_host = [sum(s.get(k, 0.0) for k in MOE_COMPONENTS) * 1e6 / n_moe for s in decode_steps]
    calls = {k: round((v - calls0.get(k, 0)) / len(per_step) / n_moe, 2) for k, v in probes.calls.items()}
    return {"steps": len(decode_steps), "moe_layers": n_moe,
            "us_per_step": med, "us_per_moe_layer": {k: v / n_moe for k, v in med.items()},
            "moe_host_us_per_layer": statistics.median(moe_host),
            "step_ms": med["step"] / 1e3, "calls_per_moe_layer_per_step": calls}, tokens


def experts_alone(eng, reps: int, clock) -> dict:
    """The experts path of layer 0 alone, on the CPU, over `reps` random tokens: router (not timed), then
    every group fused (`experts_blocks`) and `finish`; host time = that span less the native kernel's
    calls. Steadier than the whole step on a busy machine (no attention, head or scheduler between)."""
    from engine import kernels
    from engine.models import moe

    ex, cfg = eng.executor, eng.config
    groups = [(ex.store.sublayers[f"layers.0.experts.{g}"].host_views, experts)
              for g, experts in enumerate(cfg.expert_groups())]
    router = {k: v.cpu() for k, v in ex.store.sublayers["layers.0.ffn"].host_views.items()}
    lib = kernels._load()
    spent = [0.0]
    probes = Probes(clock)
    if lib is not None:
        probes.wrap(lib, "sl_linear_batch", "native kernel")
    g = torch.Generator().manual_seed(0)
    host = []
    try:
        with torch.inference_mode():
            for i in range(reps + 10):
                x = torch.randn(1, cfg.hidden_size, generator=g).to(router["router.weight"].dtype)
                s = moe.router_block(cfg, router, x)
                k0 = probes.total.get("native kernel", 0.0)
                t0 = clock()
                moe.finish(moe.experts_blocks(cfg, groups, s))
                spent[0] = clock() - t0 - (probes.total.get("native kernel", 0.0) - k0)
                if i >= 10:
                    host.append(spent[0])
    finally:
        probes.restore()
    q = statistics.quantiles(host, n=4)
    return {"reps": reps, "host_us_median": statistics.median(host) * 1e6, "host_us_p25": q[0] * 1e6,
            "host_us_p75": q[2] * 1e6}


def profiled_pass(eng, steps: int) -> dict:
    """Host time per sub-layer kind from the executor's profiler ranges, and the ops per MoE layer, over
    the decode steps (each step in a range of its own, so the prompt's prefill is left out)."""
    ex = eng.executor
    decode(eng, 2)
    real_forward = ex.forward_batch

    def forward_batch(items):
        with torch.profiler.record_function(f"step:{sum(len(it.ids) for it in items)}"):
            return real_forward(items)

    ex.forward_batch = forward_batch
    ex.label_sublayers = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            decode(eng, steps + 1)
    finally:
        ex.label_sublayers = False
        del ex.forward_batch
    events = prof.events()
    decode_steps = {id(ev) for ev in events if ev.name == "step:1"}
    kinds: dict[str, list[float]] = defaultdict(list)
    ranges = set()
    for ev in events:
        if ":" in ev.name and not ev.name.startswith(("step:", "aten::")) and ev.cpu_parent is not None \
                and id(ev.cpu_parent) in decode_steps:
            ranges.add(id(ev))
            sub = ev.name.split(":")[0]
            kinds[sub.split(".")[2] if sub.startswith("layers.") else sub].append(ev.cpu_time_total)
    ops: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for ev in events:
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and id(parent) not in ranges and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is None or id(parent) not in ranges or not parent.name.startswith("layers."):
            continue     # (ops called by other ops are counted in their caller)
        kind = parent.name.split(":")[0].split(".")[2]
        if kind in ("ffn", "experts"):
            o = ops[f"{kind}: {ev.name}"]
            o[0] += 1
            o[1] += ev.cpu_time_total
    n_steps = len(decode_steps)
    n_moe = sum(eng.config.is_moe_layer(i) for i in range(eng.config.num_layers))
    by_kind = {k: {"ranges": len(v), "median_us": statistics.median(v), "total_us_per_step": sum(v) / n_steps}
               for k, v in kinds.items()}
    top = sorted(ops.items(), key=lambda kv: -kv[1][1])
    return {"decode_steps": n_steps, "sublayer_kinds": by_kind,
            "ops_per_moe_layer": {k: {"calls": c / n_steps / n_moe, "us": us / n_steps / n_moe}
                                  for k, (c, us) in top[:30]},
            "op_calls_per_moe_layer": sum(c for c, _ in ops.values()) / n_steps / n_moe}


def print_tables(res: dict) -> None:
    t = res["timed"]
    print(f"\ndecode step: {t['step_ms']:.2f} ms (median of {t['steps']}), {t['moe_layers']} MoE layers; "
          f"MoE host time outside the native kernel: {t['moe_host_us_per_layer']:.0f} µs per layer")
    print("| component | µs / step | µs / MoE layer |")
    print("|---|---|---|")
    for k, v in t["us_per_step"].items():
        if k != "step":
            print(f"| {k} | {v:.0f} | {t['us_per_moe_layer'][k]:.0f} |")
    print(f"\nwithout probes: decode step {res['plain_step_ms']:.2f} ms (median of {res['plain_steps']})")
    a = res["experts_alone"]
    print(f"layer 0's experts path alone (router excluded): host time outside the kernel {a['host_us_median']:.0f} µs "
          f"(p25 {a['host_us_p25']:.0f}, p75 {a['host_us_p75']:.0f}, {a['reps']} tokens)")
    p = res.get("profiled")
    if p:
        print("\nprofiler ranges (label_sublayers), host µs per range (profiler overhead included):")
        print("| sub-layer kind | ranges | median µs | µs / step |")
        print("|---|---|---|---|")
        for k, v in p["sublayer_kinds"].items():
            print(f"| {k} | {v['ranges']} | {v['median_us']:.0f} | {v['total_us_per_step']:.0f} |")
        print(f"\nPyTorch ops per MoE layer (router + experts): {p['op_calls_per_moe_layer']:.1f}")
        print("| op | calls / layer | µs / layer |")
        print("|---|---|---|")
        for k, v in p["ops_per_moe_layer"].items():
            print(f"| {k} | {v['calls']:.1f} | {v['us']:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=3, help="layers of the Qwen3-30B-A3B shape (full width)")
    ap.add_argument("--device", default="sim", help="sim, cpu or cuda")
    ap.add_argument("--budget", default="8GiB")
    ap.add_argument("--plan", choices=("static", "planner"), default="static",
                    help="static: attention, routers and head resident, experts on the CPU; planner: the "
                         "planner's own plan at the budget (at small budgets whole MoE layers on the CPU as one "
                         "call, and the GPU attention between them run from the host)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed")
    ap.add_argument("--n-ctx", type=int, default=512, help="the engine's context (its KV cache takes VRAM the "
                    "planner could give weights: at 2 GiB, 512 puts 18 of 24 attentions on the CPU, 4096 none)")
    ap.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                    help="wall (perf_counter), or thread: this thread's CPU time (steadier on a busy machine; the "
                         "kernel's worker threads are not counted)")
    ap.add_argument("--reps", type=int, default=200, help="tokens of the experts-alone pass")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler pass")
    ap.add_argument("--tag", default="", help="suffix of the JSON file's name (e.g. before/after)")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    command = " ".join(["python -m engine.bench.moe_host_overhead"] + (argv if argv is not None else sys.argv[1:]))
    from engine import kernels

    eng = open_engine(args.layers, args.device, args.budget, args.plan, args.n_ctx)
    try:
        kernels._load()
        tier = eng.plan_report()["tiers"][0]
        res = {"device": args.device, "layers": args.layers, "plan_source": args.plan, "n_ctx": args.n_ctx,
               "cpu_matmul": kernels.status(wait=True), "threads": torch.get_num_threads(), "plan": tier["plan"],
               "placement": tier.get("placement")}
        clock = CLOCKS[args.clock]
        decode(eng, 4)                                # warm-up
        res["clock"] = args.clock
        plain = plain_pass(eng, args.steps, clock)
        res["plain_step_ms"], res["plain_steps"] = statistics.median(plain) * 1e3, len(plain)
        res["timed"], tokens = timed_pass(eng, args.steps, clock)
        if eng.executor.graphs is not None:
            res["graphs"] = eng.executor.graphs.stats()
        res["greedy_tokens"] = tokens
        res["experts_alone"] = experts_alone(eng, args.reps, clock)
        if not args.no_profile:
            res["profiled"] = profiled_pass(eng, max(4, args.steps // 2))
    finally:
        eng.close()
    print_tables(res)
    name = "moe_host_overhead" + (f"_{args.device}" if args.device != "sim" else "") + (f"_{args.tag}" if args.tag else "")
    path = write_report(Path(args.out), name, res, command)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
