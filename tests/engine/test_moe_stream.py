"""Routed expert streaming: a streamed expert group copies only the experts its router picked.

- `score()` matches transformers within 1e-3 relative with routed streaming forced in every step, under
  plans whose expert groups stream (every group, or a random mix), with one to three slots;
- greedy tokens equal the plain CPU run's while the budget moves mid-generation and decode steps stream
  routed experts;
- a decode step copies at most k experts per MoE layer (whole-group streaming copies every streamed
  group), so the bytes copied shrink;
- the estimator prices a routed copy by the expected touched experts and holds it until its router has
  run; the planner streams expert groups for decode where that pays.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import numpy as np
import pytest

import engine
from engine.sharding.plan import Placement, Plan, PlanSet
from engine.sharding.spec import ModelSpec
from tests.engine.reference import rel_err, transformers_logits
from tests.engine.test_moe import IDS, open_tiny
from tests.engine.tiny_plans import slow_cpu_profile, third_of_weights

R, S, C = Placement.RESIDENT, Placement.STREAMED, Placement.CPU


def use_placement(eng, placement: dict, n_slots: int = 2) -> None:
    """Run every tier of `eng` under `placement` (a manual plan, as a forced plan would be)."""
    planset = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), n_slots) for t in eng.tiers])
    eng._make_planset = lambda budget, kv_tokens=None, ps=planset: ps
    eng.set_vram_budget(eng.budget)


def groups_streamed(eng) -> dict:
    """Expert groups streamed; attention, routers, dense FFNs and the head resident; embedding on the CPU."""
    return {s.name: S if s.kind == "experts" else C if s.kind == "embed" else R for s in eng.spec.sublayers}


def expert_block_bytes(eng) -> int:
    """Bytes of one expert in a group's packed buffer."""
    sw = next(w for n, w in eng.executor.store.sublayers.items() if ".experts." in n)
    cfg = eng.config
    return sw.nbytes // len(cfg.expert_groups()[0])


# ---- fidelity --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,group", [("qwen3_moe", 0), ("qwen3_moe", 3), ("mixtral", 3)])
def test_score_matches_transformers_with_routed_streaming(tiny_model, arch, group):
    path = tiny_model(arch)
    ref = transformers_logits(path, IDS)
    eng = open_tiny(path, group, vram_budget="1GiB")
    eng.executor.routed_experts = True          # every step copies routed experts only
    rng = random.Random(5)
    names = [s.name for s in eng.spec.sublayers]
    plans = [(groups_streamed(eng), 1), (groups_streamed(eng), 3)]
    mixed = {n: rng.choice(list(Placement)) for n in names}
    mixed.update({n: S for n in names if ".experts." in n and rng.random() < 0.6})
    plans.append((mixed, 2))
    for placement, n_slots in plans:
        use_placement(eng, placement, n_slots)
        before = eng.executor.routed_loads
        got = eng.score(IDS)
        assert rel_err(got, ref) < 1e-3, (placement, n_slots)
        assert eng.executor.routed_loads > before           # the routed path really ran
        assert eng.accel.total_used <= eng.budget
    eng.close()


def test_score_with_many_experts_streams_routed_by_rule(tiny_model):
    """32 experts, top 2: steps of up to 4 tokens stream routed experts without forcing; scoring in
    4-token steps matches transformers."""
    path = tiny_model("qwen3_moe", num_experts=32)
    ref = transformers_logits(path, IDS[:40])
    eng = open_tiny(path, 8, vram_budget="1GiB")
    use_placement(eng, groups_streamed(eng), 2)
    eng.planset.step_tokens = 4
    got = eng.score(IDS[:40])
    assert rel_err(got, ref) < 1e-3
    assert eng.executor.routed_loads > 0
    eng.close()


# ---- live budget changes ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_greedy_unchanged_across_budget_changes_with_routed_streaming(tiny_model, arch):
    path = tiny_model(arch)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("a b c d e", max_new_tokens=36)]
    cpu.close()
    eng = open_tiny(path, 3)
    room = third_of_weights(eng)
    eng.set_vram_budget(room)
    eng.force_plan("gpu_only")
    streamed_groups = []
    activate = eng.executor.activate

    def spy(plan, *args, **kwargs):
        streamed_groups.append(sum(1 for n, p in plan.placement.items() if ".experts." in n and p is S))
        return activate(plan, *args, **kwargs)

    eng.executor.activate = spy
    budgets = [room // 2, room * 3, room, 0, room // 3, room * 2]
    got = []
    for i, ev in enumerate(eng.generate("a b c d e", max_new_tokens=36)):
        got.append(ev.token_id)
        if i % 6 == 2:
            t = threading.Thread(target=eng.set_vram_budget, args=(budgets[(i // 6) % len(budgets)],))
            t.start()
            t.join()
    assert got == want
    assert len(eng.replans) >= 4
    assert max(streamed_groups) > 0 and eng.executor.routed_loads > 0     # decode streamed routed experts
    assert eng.accel.peak <= max(r["budget"] for r in eng.replans)
    eng.close()


# ---- bytes copied ----------------------------------------------------------------------------------

def decode_bytes(eng, routed: bool | None, n_new: int) -> tuple[list[int], int, int]:
    """(tokens, bytes copied from the first token on, decode steps) of a greedy generation."""
    eng.executor.routed_experts = routed
    tokens, start = [], None
    for ev in eng.generate("a b c d e", max_new_tokens=n_new):
        if start is None:
            start = eng.executor.copied_bytes
        tokens.append(ev.token_id)
    return tokens, eng.executor.copied_bytes - start, len(tokens) - 1


@pytest.mark.parametrize("arch,group", [("qwen3_moe", 0), ("qwen3_moe", 4), ("mixtral", 4)])
def test_routed_decode_copies_fewer_bytes(tiny_model, arch, group):
    path = tiny_model(arch)
    eng = open_tiny(path, group, vram_budget="1GiB")
    use_placement(eng, groups_streamed(eng), 2)
    whole_tokens, whole, steps = decode_bytes(eng, False, 24)
    routed_tokens, routed, _ = decode_bytes(eng, None, 24)
    assert routed_tokens == whole_tokens
    cfg, block = eng.config, expert_block_bytes(eng)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    group_bytes = sum(w.nbytes for n, w in eng.executor.store.sublayers.items() if ".experts." in n)
    # Whole-group streaming copies every streamed group each step (they outnumber the slots) ...
    assert whole >= (steps - 1) * group_bytes
    # ... routed streaming at most the k experts of each token per MoE layer (one step's slack for the
    # copies issued across a step boundary).
    assert routed <= (steps + 1) * cfg.num_experts_per_tok * moe_layers * block
    assert routed < 0.5 * whole
    eng.close()


def test_a_group_that_keeps_its_slot_tops_up_missing_experts(tiny_model):
    """Two streamed groups, two slots: each keeps its slot, so over a decode the routed copies add up
    to at most the two groups' bytes, and tokens match the CPU run."""
    path = tiny_model("qwen3_moe")
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("a b c d e", max_new_tokens=20)]
    cpu.close()
    eng = open_tiny(path, 4, vram_budget="1GiB")
    placement = {s.name: C if s.kind == "embed" else R for s in eng.spec.sublayers}
    two = ["layers.0.experts.1", "layers.1.experts.0"]
    placement.update({n: S for n in two})
    use_placement(eng, placement, 2)
    eng.executor.routed_experts = True
    got = [e.token_id for e in eng.generate("a b c d e", max_new_tokens=20)]
    assert got == want
    assert 0 < eng.executor.copied_bytes <= sum(eng.executor.store.nbytes(n) for n in two)
    eng.close()


# ---- the estimator and the planner -----------------------------------------------------------------

def _shape(layers: int = 24):
    from engine.bench.shapes import get_shape

    return ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=layers))


def test_routed_copy_costs_follow_the_touched_experts():
    from engine.sharding.estimator import Estimator
    from engine.sharding.profile import ProfileDatabase
    from engine.sharding.spec import routed_streaming

    spec = _shape(4)
    est = Estimator(spec, ProfileDatabase.sim())
    names = [s.name for s in spec.sublayers]
    i = names.index("layers.2.experts.3")
    group = spec.sublayers[i]
    assert routed_streaming(spec.config, 1) and routed_streaming(spec.config, 4)
    assert not routed_streaming(spec.config, 16)
    for t in (1, 4):
        c = est.costs(t, 512)
        frac = spec.expected_experts(group, t) / group.n_experts
        assert c.copy_alone_ms[i] == pytest.approx(est.copy_alone[i] * frac)
        assert c.copy_gate[i] == names.index("layers.2.ffn")
        assert c.copy_gate[names.index("layers.2.attn")] == -1
    assert est.costs(64, 512).copy_gate is None                 # a long step copies whole groups


def test_routed_copies_wait_for_their_router():
    """All expert groups streamed, decode: the step is at least the routed copies back to back, and
    holding each copy until its router runs costs time over a schedule that ignored the router."""
    from engine.sharding.estimator import Estimator
    from engine.sharding.profile import ProfileDatabase

    spec = _shape(4)
    est = Estimator(spec, ProfileDatabase.sim())
    pl = {s.name: S if s.kind == "experts" else C if s.kind == "embed" else R for s in spec.sublayers}
    place = est.encode(pl)[None, :]
    c = est.costs(1, 512)
    is_exp = np.array([s.kind == "experts" for s in spec.sublayers])
    t = est.simulate(place, 1, 512, 2)[0]
    assert t >= c.copy_alone_ms[is_exp].sum()
    free = est.pipeline(place, 2).run(dataclasses.replace(c, copy_gate=None), est.rho)[0]
    assert free < t
    whole = est.pipeline(place, 2).run(dataclasses.replace(c, copy_gate=None, copy_alone_ms=None,
                                                            copy_busy_ms=None), est.rho)[0]
    assert t < whole / 4                  # whole groups: 16 experts' bytes where decode touches about 1


def test_planner_streams_routed_experts_for_decode_where_it_pays(monkeypatch):
    """On a profile with a slow CPU the decode plan streams expert groups, and predicts less time than
    the best plan priced as if every streamed group were copied whole."""
    from engine.sharding import spec as spec_mod
    from engine.sharding.planner import Planner

    spec = _shape(8)
    ps = Planner(spec, slow_cpu_profile(), tiers=(1, 64)).plan("4GiB", kv_tokens=4096)
    decode = ps.plans[0]
    assert any(decode.placement[s.name] is S for s in spec.sublayers if s.kind == "experts")
    monkeypatch.setattr(spec_mod, "ROUTED_STREAM_MAX", 0.0)
    whole = Planner(spec, slow_cpu_profile(), tiers=(1, 64)).plan("4GiB", kv_tokens=4096).plans[0]
    assert decode.predicted_ms < 0.5 * whole.predicted_ms


# ---- the standalone decode benchmark ---------------------------------------------------------------

def test_moe_decode_bench_runs_on_sim(tmp_path, capsys):
    """engine.bench.moe_decode on the tiny MoE shape: a row per budget and mode with the decode plan,
    and the routed row copies fewer bytes per step than the whole-group baseline of the same plan."""
    import json

    from engine.bench.moe_decode import main

    assert main(["--device", "sim", "--model", "tiny-moe", "--budgets", "3MiB", "--kinds", "gpu_only",
                 "--tiers", "1,4", "--tokens", "8", "--out", str(tmp_path)]) == 0
    out = json.loads((tmp_path / "moe_decode.json").read_text())
    assert out["command"].startswith("python -m engine.bench.moe_decode") and out["machine"] and out["date"]
    routed, whole = out["rows"]
    assert (routed["routed"], whole["routed"]) == (True, False)
    assert routed["decode_plan"]["placements"]["experts"].get("streamed", 0) > 0
    assert routed["decode_tps"] > 0 and routed["plan"]["tiers"][0]["by_kind"]["experts"]
    assert routed["routed_loads_per_step"] > 0 and whole["routed_loads_per_step"] == 0
    assert 0 < routed["copied_bytes_per_step"] < 0.6 * whole["copied_bytes_per_step"]
    assert "| 3MiB | gpu_only | routed |" in capsys.readouterr().out
