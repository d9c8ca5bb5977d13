"""TorchEngine.move_to_cpu: the planner's plans with named sub-layers computed on the CPU, for benchmarks that
set such a placement beside the chosen one in one engine. A plan changes speed, never the tokens."""

from __future__ import annotations

import engine
from engine.sharding.plan import Placement
from engine.sharding.planner import Planner


def test_moving_sub_layers_to_the_cpu_keeps_the_tokens_and_comes_back(tiny_model, monkeypatch):
    real_plan = Planner.plan

    def gpu_attention(self, *args, **kwargs):   # (the sim profile plans this tiny model on the CPU)
        planset = real_plan(self, *args, **kwargs)
        for p in planset.plans:
            for name in p.placement:
                if name.endswith((".attn", ".ffn")):
                    p.placement[name] = Placement.RESIDENT
            p.kv_layers = None
        return planset

    monkeypatch.setattr(Planner, "plan", gpu_attention)
    eng = engine.open_model(tiny_model("qwen3"), device="sim", backend="torch")
    eng.set_vram_budget(eng.spec.total_weight_bytes * 4)
    want = [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=3)]
    kv = eng.executor.kv
    assert all(p.on_gpu for p in kv.pools)

    eng.move_to_cpu(["layers.*.attn"])
    plan = eng.executor.plan
    assert plan.kind == "manual" and all(plan.placement[f"layers.{i}.attn"] is Placement.CPU for i in range(2))
    assert all(plan.placement[f"layers.{i}.ffn"] is Placement.RESIDENT for i in range(2))
    assert eng.plan_report()["moved_to_cpu"] == ["layers.*.attn"]
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=3)] == want
    assert not any(p.on_gpu for p in kv.pools)            # the moved attentions' KV is in host memory
    assert eng.accel.total_used <= eng.budget

    eng.move_to_cpu(())
    plan = eng.executor.plan
    assert all(plan.placement[f"layers.{i}.attn"] is Placement.RESIDENT for i in range(2))
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=3)] == want
    assert all(p.on_gpu for p in kv.pools)
    assert any("moved to the CPU" in r["reason"] for r in eng.replans)

    # a "kv_layers=N" entry sets the GPU-resident KV prefix: layer 1's attention stays on the GPU over its
    # KV in host memory
    eng.move_to_cpu(["layers.*.attn=resident", "kv_layers=1"])
    plan = eng.executor.plan
    assert plan.kv_layers == 1 and plan.host_kv_attention(1) and not plan.host_kv_attention(0)
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=3)] == want
    assert [p.on_gpu for p in kv.pools] == [True, False]
    assert eng.accel.total_used <= eng.budget
    eng.close()


def test_moving_sub_layers_to_the_gpu_keeps_the_tokens_within_the_budget(tiny_model):
    """"PATTERN=PLACE" entries: attention streamed and the head resident keep the tokens and the budget; a
    tier whose moved plan would not fit keeps the planner's plan; a bad entry fails before anything moves."""
    import pytest

    from engine.errors import BadInputError

    eng = engine.open_model(tiny_model("llama"), device="sim", backend="torch")
    eng.set_vram_budget(eng.spec.total_weight_bytes * 4)
    want = [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=5)]
    eng.move_to_cpu(["layers.*.attn=streamed", "head=resident", "layers.*.ffn=cpu"])
    plan = eng.executor.plan
    assert plan.kind == "manual" and plan.placement["head"] is Placement.RESIDENT
    assert all(plan.placement[f"layers.{i}.attn"] is Placement.STREAMED for i in range(2))
    assert all(plan.placement[f"layers.{i}.ffn"] is Placement.CPU for i in range(2))
    copied = eng.stats()["streamed_bytes"]
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=5)] == want
    assert eng.stats()["streamed_bytes"] > copied or len(plan.streamed()) <= plan.n_slots
    assert eng.accel.total_used <= eng.budget
    with pytest.raises(BadInputError, match="PLACE one of"):
        eng.move_to_cpu(["head=vram"])
    assert eng.executor.plan.placement["head"] is Placement.RESIDENT      # (nothing moved)
    eng.set_vram_budget(eng.spec.by_name()["head"].weight_bytes // 2)     # the head no longer fits
    assert eng.executor.plan.placement["head"] is not Placement.RESIDENT
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=12, seed=5)] == want
    assert eng.accel.total_used <= eng.budget
    eng.close()
