"""Planning settings that make tiny test models place work on the (simulated) GPU.

A tiny model's weights are smaller than its KV cache and a large tier's scratch, and on the default "sim"
profile its CPU is fast enough that every plan stays on the CPU. Tests that must exercise GPU placements
plan with tiers up to 64 tokens and a profile whose CPU is 1000x slower.
"""

from __future__ import annotations

TIERS = (1, 4, 16, 64)


def slow_cpu_profile():
    from engine.sharding.profile import ProfileDatabase, sim_profile_dict

    data = sim_profile_dict()
    cpu = data["cpu"]
    for classes in cpu["gemm"].values():
        for rows in classes.values():
            for row in rows:
                row[1] /= 1000
    for rates in cpu["attention"].values():
        rates["gbps"] /= 1000
        rates["gflops"] /= 1000
    cpu["op_overhead_us"] *= 100
    return ProfileDatabase(data)


def third_of_weights(eng) -> int:
    """A third of the weights, plus the KV cache and the largest tier's scratch."""
    from engine.sharding.memory import kv_cache_bytes, scratch_bytes

    spec = eng.spec
    return spec.total_weight_bytes // 3 + kv_cache_bytes(spec, eng.kv_tokens) + scratch_bytes(spec, TIERS[-1])


def all_cpu_planset(self, budget, kv_tokens=None):
    """A `TorchEngine._make_planset` stand-in: every tier on the CPU (tests patch it in so that engines open
    on a plan of their own and then force theirs with `force_planset`)."""
    from engine.sharding.plan import Placement, Plan, PlanSet

    return PlanSet(budget, [Plan(t, "manual", {s.name: Placement.CPU for s in self.spec.sublayers}, 0)
                            for t in self.tiers])


def force_planset(eng, planset) -> None:
    """From now on `eng` plans `planset` for any budget; re-planned at its budget at once."""
    eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
    eng.set_vram_budget(eng.budget)


def plain_on_gpu(device: str) -> dict:
    """`open_model` options for an engine on the test device whose tokens are compared with another's: on a
    GPU, no n-gram speculation. Whether a step verifies proposals is decided from measured step times, and a
    verify step is a multi-token step, whose kernels on a GPU round apart from a one-token step's: where a
    tiny random model's logits all but tie, the token would move with the timing (session 26, calls BO-BV).
    On "sim" and the CPU speculation gives plain decoding's bits, and stays on as by default."""
    return {"speculative": False} if str(device).startswith("cuda") else {}
