"""A re-plan asked for by a prompt (its KV grown or cut) brings in the plan of the step about to run, not the
one-token plan that step would replace at once; a prompt mostly cached keeps the one-token plan."""

from __future__ import annotations

import pytest

import engine
from engine.sharding.plan import Placement, Plan, PlanSet

LONG = "a b c d " * 60


def _two_plan_kinds(self, budget, kv_tokens=None):
    """FFNs resident in the small-step tiers, attentions resident in the larger ones."""
    plans = []
    for t in self.tiers:
        kind = "ffn" if t <= 16 else "attn"
        plans.append(Plan(t, "manual", {s.name: Placement.RESIDENT if s.kind == kind else Placement.CPU
                                        for s in self.spec.sublayers}, 0))
    return PlanSet(budget, plans)


@pytest.fixture
def eng(tiny_model, monkeypatch):
    from engine.backends import torch_engine
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(torch_engine, "INITIAL_KV_TOKENS", 64)       # a 240-token prompt grows the KV
    monkeypatch.setattr(TorchEngine, "_make_planset", _two_plan_kinds)
    e = engine.open_model(tiny_model("llama3"), device="sim", backend="torch")
    e.set_vram_budget(e.spec.total_weight_bytes * 2)
    yield e
    e.close()


def _tokens_and_activations(eng, prompt: str, n: int = 3) -> tuple[list[int], list[int]]:
    seen = []
    real = eng.executor.activate

    def activate(plan, *args, **kwargs):
        seen.append(plan.tier)
        return real(plan, *args, **kwargs)

    eng.executor.activate = activate
    try:
        return [e.token_id for e in eng.generate(prompt, max_new_tokens=n) if e.token_id is not None], seen
    finally:
        eng.executor.activate = real


def test_a_long_prompt_growing_the_kv_brings_in_its_own_plan_first(eng, tiny_model, monkeypatch):
    from engine.backends.torch_engine import TorchEngine
    from tests.engine.tiny_plans import all_cpu_planset

    _tokens_and_activations(eng, "a b c")
    kv_before = eng.kv_tokens
    got, seen = _tokens_and_activations(eng, LONG)
    assert eng.kv_tokens > kv_before and "context grew" in eng.replans[-1]["reason"]
    assert seen == [256, 1]                 # the prompt's plan, then the decode's: no one-token plan before
    # a shorter prompt after it cuts the KV back, and its step is small: the one-token plan
    _, seen = _tokens_and_activations(eng, "x y")
    assert seen == [1] and "KV capacity cut" in eng.replans[-1]["reason"]
    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)      # (the reference: the CPU alone)
    fresh = engine.open_model(tiny_model("llama3"), device="cpu", backend="torch")
    try:
        assert got == [e.token_id for e in fresh.generate(LONG, max_new_tokens=3) if e.token_id is not None]
    finally:
        fresh.close()


def test_a_prompt_mostly_cached_keeps_the_one_token_plan(eng):
    _tokens_and_activations(eng, LONG)
    _tokens_and_activations(eng, "x y")                 # cut: the long prompt's blocks go to the host tier
    kv_before = eng.kv_tokens
    ids = eng.encode_prompt(LONG + "e f")
    assert len(ids) - eng.executor.kv.cached_prefix(ids) <= 16
    _, seen = _tokens_and_activations(eng, LONG + "e f")
    assert eng.kv_tokens > kv_before
    assert seen == [1]                      # its new tokens are a small step: they run on the one-token plan
    assert eng.executor.kv.prefix_stats["hit_tokens"] > 0
