"""Small-step tiers planned apart from the prompts' tiers (`Planner(split_small=True)`,
`TorchEngine.split_plans`): what the planner picks, and that an engine whose decode plan keeps fewer layers'
KV cache and another head placement than its prompt plan gives the same tokens within its budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import engine
from engine.bench.shapes import get_shape
from engine.commands.plan import profile_from_file
from engine.sharding.memory import vram_breakdown
from engine.sharding.plan import Placement, PlanSet
from engine.sharding.planner import SPLIT_TIER, Planner
from engine.sharding.spec import ModelSpec
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

H200 = Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json"
MOE_2GIB = 1_119_879_168          # the suite's bookable bytes at 2 GiB (Qwen3-30B-A3B shape, 24 layers)


@pytest.fixture(scope="module")
def moe():
    spec = ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24))
    prof = profile_from_file(H200)
    return spec, Planner(spec, prof), Planner(spec, prof, split_small=True)


def shared(plan) -> tuple:
    return plan.kv_layers, plan.placement["head"] is Placement.RESIDENT


def test_split_plans_share_within_each_side_and_the_decode_tier_gains(moe):
    """At 2 GiB the MoE shape's prompts want every layer's KV in VRAM, which leaves the head on the CPU in
    the shared choice (6 ms of each decode step); apart, the decode tiers keep fewer layers' KV and the head
    off the CPU, predicted faster; the prompt tiers keep their plans."""
    _, together, apart = moe
    a = together.plan(MOE_2GIB, kv_tokens=2048, tier_reserve={1: 64 << 20})
    b = apart.plan(MOE_2GIB, kv_tokens=2048, tier_reserve={1: 64 << 20})
    assert len({shared(p) for p in a.plans}) == 1
    small = [p for p in b.plans if p.tier <= SPLIT_TIER]
    large = [p for p in b.plans if p.tier > SPLIT_TIER]
    assert len({shared(p) for p in small}) == 1 and len({shared(p) for p in large}) == 1
    assert shared(small[0]) != shared(large[0])
    assert b.plans[0].predicted_ms < 0.95 * a.plans[0].predicted_ms
    assert [p.predicted_ms for p in large] == [p.predicted_ms for p in a.plans if p.tier > SPLIT_TIER]
    assert all(p.vram.total <= MOE_2GIB for p in b.plans)


def test_the_moves_at_each_switch_are_priced(moe, monkeypatch):
    """With the KV and head moves priced far above what the decode tier saves, the split keeps one choice."""
    _, _, apart = moe
    monkeypatch.setattr(apart, "_split_cost", lambda g_small, g_large, kv: 0.0 if g_small == g_large else 1e9)
    b = apart.plan(MOE_2GIB, kv_tokens=2048, tier_reserve={1: 64 << 20})
    assert len({shared(p) for p in b.plans}) == 1


def test_an_engine_whose_decode_plan_keeps_less_kv_in_vram_gives_the_same_tokens(tiny_model, monkeypatch):
    """The small tiers' plans keep only layer 0's KV cache in VRAM, its attention there, and the head on
    the CPU, where the prompt tier's plan has more: each switch moves KV between VRAM and host memory. Two
    turns of a conversation give the CPU engine's tokens, every step within the budget, and each layer's KV
    ends where the plan in force wants it."""
    real = Planner.plan

    def split(self, budget, kv_tokens=4096, *args, **kwargs):
        ps = real(self, budget, kv_tokens, *args, **kwargs)
        plans = []
        for p in ps.plans:
            if p.tier <= SPLIT_TIER:
                place = dict(p.placement)
                for name in place:
                    if name.endswith(".attn") and name != "layers.0.attn":
                        place[name] = Placement.CPU
                place["head"] = Placement.CPU
                place["layers.0.attn"] = Placement.RESIDENT
                vram = vram_breakdown(self.spec, place, p.tier, kv_tokens, p.n_slots, 1)
                p = dataclasses.replace(p, placement=place, kv_layers=1, vram=vram)
            plans.append(p)
        return PlanSet(ps.budget, plans, step_tokens=TIERS[-1])      # (prompts as one step on their tier's plan)

    monkeypatch.setenv("SLIPSTREAM_PLAN_SPLIT", "0")         # (the large tiers as the shared choice plans them)
    path = tiny_model("llama3")
    ref = engine.open_model(path, device="cpu", backend="torch", speculative=False)
    want = [[e.token_id for e in ref.generate(p, max_new_tokens=8)] for p in ("a b c d e f g h i j k l m n o p q r s t",
                                                                                "u v w x y z a b c d e f g")]
    ref.close()
    monkeypatch.setattr(Planner, "plan", split)
    eng = engine.open_model(path, device="sim", backend="torch", tiers=TIERS, profile=slow_cpu_profile(),
                            speculative=False)
    eng.set_vram_budget(third_of_weights(eng))
    over, kv_seen = [], set()
    fb = eng.executor.forward_batch

    def forward_batch(items):
        out = fb(items)
        kv_seen.add(tuple(p.on_gpu for p in eng.executor.kv.pools))
        if eng.accel.total_used > eng.budget:
            over.append(eng.accel.total_used)
        return out

    eng.executor.forward_batch = forward_batch
    got = [[e.token_id for e in eng.generate(p, max_new_tokens=8)] for p in ("a b c d e f g h i j k l m n o p q r s t",
                                                                             "u v w x y z a b c d e f g")]
    plan = eng.executor.plan
    assert plan.tier <= SPLIT_TIER and plan.kv_layers == 1         # (the decode plan in force at the end)
    assert got == want and not over
    assert len(kv_seen) >= 2                  # (the KV cache moved between VRAM and host at the switches)
    assert [p.on_gpu for p in eng.executor.kv.pools] == [plan.kv_on_gpu(i) for i in range(eng.config.num_layers)]
    assert any(p.tier > SPLIT_TIER and (p.kv_layers is None or p.kv_layers > 1) for p in eng.planset.plans)
    eng.close()


def test_the_engine_switch_re_plans_and_reports(tiny_model, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_PLAN_SPLIT", raising=False)
    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch", tiers=TIERS, profile=slow_cpu_profile())
    eng.set_vram_budget(third_of_weights(eng))
    assert eng.plan_report()["split_plans"] is False
    eng.split_plans(True)
    assert eng.plan_report()["split_plans"] is True and eng.planner().split_small
    assert any("planned apart" in r["reason"] for r in eng.replans)
    eng.split_plans(False)
    assert not eng.planner().split_small
    eng.close()
