"""Planner properties over random model shapes and budgets, on the deterministic "sim" profile."""

from __future__ import annotations

import itertools
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sharding.memory import vram_breakdown
from engine.sharding.plan import PLAN_KINDS, Placement, Plan, PlanSet
from engine.sharding.planner import ONE_SLOT_TIERS, Planner, planning_context, planset_score, score
from engine.sharding.profile import ProfileDatabase
from engine.sharding.spec import ModelSpec
from tests.engine.planner_cases import is_kind, kv_sides, model_configs

SIM = ProfileDatabase.sim()
TIERS = (1, 4, 16, 64, 256, 1024)
EXAMPLES = int(os.environ.get("SLIPSTREAM_PLANNER_EXAMPLES", "40"))   # raise for a deeper search
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_planners: dict = {}


def planner_for(cfg, tiers=TIERS, n_slots=2) -> Planner:
    key = (cfg, tiers, n_slots)
    if key not in _planners:
        _planners[key] = Planner(ModelSpec.from_config(cfg), SIM, tiers=tiers, n_slots=n_slots)
    return _planners[key]


def budgets_for(planner: Planner, fractions: list[float]) -> list[int]:
    total = planner.spec.total_weight_bytes * 2
    return [int(f * total) for f in fractions]


def check_planset(planner: Planner, ps: PlanSet, budget: int, kv_tokens: int, kind: str | None) -> None:
    spec = planner.spec
    names = [s.name for s in spec.sublayers]
    assert [p.tier for p in ps.plans] == list(planner.tiers)
    sides = kv_sides(ps.plans[0])
    for p in ps.plans:
        assert list(p.placement) == names                    # every sub-layer placed, in order
        assert all(isinstance(v, Placement) for v in p.placement.values())
        assert p.vram.total <= budget
        assert p.vram.as_dict() == vram_breakdown(spec, p.placement, p.tier, kv_tokens, p.n_slots,
                                                  p.kv_layers).as_dict()
        assert kv_sides(p) == sides                         # no KV cache changes sides between tiers
        assert p.kind in PLAN_KINDS and is_kind(p, p.kind)
        assert math.isfinite(p.predicted_ms) and p.predicted_ms > 0
        again = planner.estimate(p, p.tier, planning_context(p.tier, kv_tokens))
        assert again == pytest.approx(p.predicted_ms, rel=1e-9)
    assert ps.step_tokens in planner.tiers


@SETTINGS
@given(cfg=model_configs(), fracs=st.lists(st.floats(0, 1.2), min_size=1, max_size=3),
       kv_tokens=st.sampled_from([0, 16, 300, 4096]), kind=st.sampled_from([None, *PLAN_KINDS]))
def test_every_plan_fits_and_is_consistent(cfg, fracs, kv_tokens, kind):
    planner = planner_for(cfg)
    for budget in [0, 1, 4096] + budgets_for(planner, fracs):
        ps = planner.plan(budget, kv_tokens=kv_tokens, force_kind=kind)
        check_planset(planner, ps, budget, kv_tokens, kind)


@SETTINGS
@given(cfg=model_configs(), fracs=st.lists(st.floats(0, 1.2), min_size=2, max_size=6),
       kv_tokens=st.sampled_from([16, 4096]))
def test_more_budget_never_predicts_slower(cfg, fracs, kv_tokens):
    planner = planner_for(cfg)
    budgets = sorted(budgets_for(planner, fracs))
    scores = [planset_score(planner.plan(b, kv_tokens=kv_tokens).plans) for b in budgets]
    assert all(b <= a for a, b in itertools.pairwise(scores)), scores
    for tier in (1, 64):   # one tier alone: its own predicted time never rises with the budget
        single = planner_for(cfg, tiers=(tier,))
        ms = [single.plan(b, kv_tokens=kv_tokens).plans[0].predicted_ms for b in budgets]
        assert all(b <= a for a, b in itertools.pairwise(ms)), ms


@SETTINGS
@given(cfg=model_configs(), kind=st.sampled_from([None, *PLAN_KINDS]), budget=st.sampled_from([0, 1, 1000]))
def test_tiny_budget_is_all_cpu(cfg, kind, budget):
    ps = planner_for(cfg).plan(budget, kv_tokens=4096, force_kind=kind)
    for p in ps.plans:
        assert set(p.placement.values()) == {Placement.CPU}
        assert p.vram.total == 0
        assert p.kind == "static"


@SETTINGS
@given(cfg=model_configs())
def test_huge_budget(cfg):
    planner = planner_for(cfg)
    huge = 1 << 50
    for p in planner.plan(huge, kv_tokens=4096, force_kind="gpu_only").plans:
        assert p.kind == "gpu_only"
        assert set(p.placement.values()) == {Placement.RESIDENT}
        assert p.vram.slots == 0
    resident = {s.name: Placement.CPU if s.kind == "embed" else Placement.RESIDENT
                for s in planner.spec.sublayers}
    plans = planner.plan(huge, kv_tokens=4096).plans     # auto: at least as good as all resident
    ref = [(t, planner.estimator.estimate(resident, t, planning_context(t, 4096))) for t in planner.tiers]
    assert planset_score(plans) <= score(ref) * (1 + 1e-9)


@pytest.mark.parametrize("shape", ["llama3-8b", "qwen2.5-7b", "smollm2-135m"])
def test_huge_budget_real_shapes_run_resident(shape):
    from engine.bench.shapes import get_shape

    for p in planner_for(get_shape(shape)).plan(1 << 50, kv_tokens=4096).plans:
        assert {v for n, v in p.placement.items() if n != "embed"} == {Placement.RESIDENT}
        assert p.kind == "gpu_only"


@SETTINGS
@given(cfg=model_configs(), frac=st.floats(0.05, 1.0))
def test_tiers_share_nested_resident_sets(cfg, frac):
    """Switching tiers adds or drops a tail of resident weights; MoE routers (half a megabyte each) are
    apart: one may run on the host beside its CPU experts in a decode tier and on the GPU in another."""
    planner = planner_for(cfg)
    ps = planner.plan(budgets_for(planner, [frac])[0], kv_tokens=256)
    routers = {s.name for s in planner.spec.sublayers if s.kind == "router"}
    sets = [set(p.resident()) - {"embed"} - routers for p in ps.plans]
    for a in sets:
        for b in sets:
            assert a <= b or b <= a


def test_forced_kinds_on_llama3_8b():
    from engine.bench.shapes import get_shape

    planner = planner_for(get_shape("llama3-8b"))
    for kind in PLAN_KINDS:
        ps = planner.plan("8GiB", kv_tokens=4096, force_kind=kind)
        assert ps.plans[0].kind == kind and is_kind(ps.plans[0], kind)
    for budget in ("2GiB", "5GiB", "8GiB", "20GiB"):
        auto = planset_score(planner.plan(budget, kv_tokens=4096).plans)
        for kind in ("static", "dynamic"):    # auto chooses among a superset of these
            assert auto <= planset_score(planner.plan(budget, kv_tokens=4096, force_kind=kind).plans)


def test_strict_forced_kind_raises_when_it_cannot_fit():
    from engine.bench.shapes import get_shape
    from engine.errors import BudgetError

    planner = planner_for(get_shape("llama3-8b"))
    with pytest.raises(BudgetError, match="gpu_only"):
        planner.plan("1GiB", kv_tokens=4096, force_kind="gpu_only", strict=True)
    assert planner.min_budget("gpu_only", 4096) > 1 << 30
    assert planner.min_budget("auto") == 0


def test_unknown_kind_is_a_clear_error():
    from engine.bench.shapes import get_shape
    from engine.errors import BadInputError

    with pytest.raises(BadInputError, match="plan kind"):
        planner_for(get_shape("smollm2-135m")).plan("1GiB", force_kind="fast")


def test_tier_lookup():
    plans = [Plan(t, "static", {}) for t in (1, 4, 16, 64)]
    ps = PlanSet(0, plans)
    got = [ps.for_tokens(n).tier for n in (1, 2, 4, 5, 16, 17, 64, 65, 10**6)]
    assert got == [1, 4, 4, 16, 16, 64, 64, 64, 64]


def test_profile_without_gpu_gives_all_cpu_plans():
    from engine.bench.shapes import get_shape
    from engine.sharding.profile import sim_profile_dict

    data = sim_profile_dict()
    data.update(device="cpu", gpu=None, link=None)
    planner = Planner(ModelSpec.from_config(get_shape("smollm2-135m")), ProfileDatabase(data), tiers=(1, 16))
    ps = planner.plan("64GiB", kv_tokens=1024)
    assert all(set(p.placement.values()) == {Placement.CPU} and p.vram.total == 0 for p in ps.plans)
    assert all(p.predicted_ms > 0 for p in ps.plans)


def test_token_tiers_up_to_a_batch_limit():
    from engine.sharding.planner import token_tiers

    assert token_tiers(1) == (1,)
    assert token_tiers(4096) == (1, 4, 16, 64, 256, 1024, 4096)
    assert token_tiers(2000) == (1, 4, 16, 64, 256, 1024, 2000)


def test_small_budget_prefill_attends_on_the_gpu_over_host_resident_kv():
    """Where no layer's KV fits beside the slots (Llama-3-8B shape, 1000 MiB), prefill tiers stream the
    attention to the GPU and bring each layer's KV in for the step; decode keeps attention on the CPU.
    The plan books one layer's KV beside the scratch, and predicts less than the same plan with those
    attentions on the CPU."""
    from engine.bench.shapes import get_shape
    from engine.sharding.memory import kv_cache_bytes, scratch_bytes

    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    planner = Planner(spec, SIM)
    ps = planner.plan(1000 << 20, kv_tokens=4096)
    layers = range(spec.config.num_layers)
    assert {p.kv_layers for p in ps.plans} == {0}
    decode, prefill = ps.for_tokens(1), ps.for_tokens(1024)
    assert not any(decode.host_kv_attention(i) for i in layers)
    assert all(prefill.host_kv_attention(i) for i in layers)
    assert prefill.vram.scratch == scratch_bytes(spec, prefill.tier) + kv_cache_bytes(spec, 4096, 1)
    on_cpu = dict(prefill.placement)
    on_cpu.update({f"layers.{i}.attn": Placement.CPU for i in layers})
    cpu_ms = planner.estimator.estimate(on_cpu, prefill.tier, planning_context(prefill.tier, 4096),
                                        prefill.n_slots, 0)
    assert prefill.predicted_ms < cpu_ms


def test_decode_tiers_never_attend_over_host_resident_kv():
    """With the H200 profile's measured CPU attention block (1.5x the tables), a 4 GiB budget's cheapest
    predicted decode would stream 24 attentions over host-resident KV; steps below HKV_MIN_TIER tokens
    keep attention where its KV lives (their per-layer host work is not priced), larger ones may not."""
    import json
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.sharding.planner import HKV_MIN_TIER
    from engine.sharding.profile import ProfileDatabase

    data = json.loads((Path(__file__).parents[2] / "docs/benchmarks/profiles/h200-attn-factor.json").read_text())
    prof = ProfileDatabase.from_dict(next(iter(data["profiles"].values())))
    assert prof.cpu["attn_block_factor"]["1"] > 1.4
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    ps = Planner(spec, prof).plan(3275751424, kv_tokens=4096)
    layers = range(spec.config.num_layers)
    assert HKV_MIN_TIER > 4
    for tier in (1, 4):                       # decode of one and of a few sequences
        assert not any(ps.for_tokens(tier).host_kv_attention(i) for i in layers), tier
    small = Planner(spec, prof).plan(1100 << 20, kv_tokens=4096)
    assert any(small.for_tokens(1024).host_kv_attention(i) for i in layers)


def test_a_tier_reserve_is_kept_from_that_tier_alone():
    """The one-token CUDA graphs' reserve comes out of the decode tier's plan only: a larger tier's plan
    has the whole budget (the graphs are dropped when it comes in). At Llama-3-8B's room under 2 GiB on
    the H200 profile, the reserve out of every tier had cut the prefill step from 1024 tokens to 256 (with
    the head's scratch of 256 rows of logits); it still changes the larger tiers' plans."""
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    planner = Planner(ModelSpec.from_config(get_shape("llama3-8b")), prof)
    room, reserve = 1155530752, 64 << 20
    plain = planner.plan(room, kv_tokens=4096)
    kept = planner.plan(room, kv_tokens=4096, tier_reserve={1: reserve})
    assert kept.for_tokens(1).vram.total <= room - reserve < plain.for_tokens(1).vram.total
    assert kept.step_tokens == plain.step_tokens == 1024
    for a, b in zip(plain.plans[1:], kept.plans[1:]):
        assert a.placement == b.placement and a.vram.total == b.vram.total
    everywhere = planner.plan(room - reserve, kv_tokens=4096)
    assert all(p.vram.total <= room - reserve for p in everywhere.plans)
    assert any(a.placement != b.placement for a, b in zip(everywhere.plans[1:], kept.plans[1:]))


def test_batched_decode_tiers_keep_the_resident_experts_of_the_one_token_plan():
    """A resident expert group in a step of a few tokens runs inside its layer's one call (all its experts
    read once, no per-expert launches: `moe.layer_few_tokens`), and the estimator prices it so. On the H200
    profile the batched decode tiers of the Qwen3-30B-A3B shape (24 layers) then keep every expert group
    the one-token plan keeps in VRAM; priced per routed expert, they had put every group on the CPU."""
    import dataclasses
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.estimator import step_costs

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24))
    groups = [i for i, s in enumerate(spec.sublayers) if s.kind == "experts"]
    for n in (4, 16):
        costs = step_costs(spec, prof, n, 512)
        assert (costs.gpu_res_ms[groups] < costs.gpu_ms[groups] / 2).all()
    assert step_costs(spec, prof, 1, 512).gpu_res_ms is None
    assert step_costs(spec, prof, 64, 512).gpu_res_ms is None
    for budget in (4 << 30, 8 << 30):
        ps = Planner(spec, prof).plan(budget, kv_tokens=4096)
        one = {n for n, p in ps.for_tokens(1).placement.items() if ".experts." in n and p is Placement.RESIDENT}
        assert len(one) >= 8
        for tier in (4, 16):
            plan = ps.for_tokens(tier)
            assert one <= {n for n, p in plan.placement.items() if p is Placement.RESIDENT}, (budget, tier)


def test_small_step_plans_keep_moe_layers_whole_in_vram():
    """A MoE layer partly in VRAM runs neither one-call path in a step of a few tokens (session 15, call PP:
    at 8 GiB the Qwen3-30B-A3B decode plan kept 37 expert groups resident, four whole layers and 5 of the
    next layer's 8 groups, and decoded slower than the 4 GiB plan with one whole layer). On the H200
    profile, the plans of those tiers keep whole layers: a resident prefix ends at a layer's end; prompt
    tiers may still split one."""
    import dataclasses
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.estimator import PARTIAL_MOE_LAYER_MS, Estimator

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24))
    est = Estimator(spec, prof)
    planner = Planner(spec, prof)
    for budget in (3 << 30, 4 << 30, 6 << 30, 8 << 30, 12 << 30):
        ps = planner.plan(budget, kv_tokens=4096)
        for tier in (1, 4, 16):
            plan = ps.for_tokens(tier)
            codes = est.encode(plan.placement)[None, :]
            assert est.partial_moe_layers(codes)[0] == 0, (budget, tier)
            resident = sum(p is Placement.RESIDENT for n, p in plan.placement.items() if ".experts." in n)
            assert resident % 8 == 0, (budget, tier, resident)
    # the price: one layer with 5 of its 8 groups in VRAM, in steps of 1 and 16 tokens, not of 64
    place = {s.name: Placement.CPU for s in spec.sublayers}
    place.update({f"layers.0.experts.{g}": Placement.RESIDENT for g in range(5)})
    whole = dict(place, **{f"layers.0.experts.{g}": Placement.CPU for g in range(5)})
    codes = est.encode(place)[None, :]
    assert est.partial_moe_layers(codes)[0] == 1
    assert est.partial_moe_layers(est.encode(whole)[None, :])[0] == 0
    for n, extra in ((1, PARTIAL_MOE_LAYER_MS), (16, PARTIAL_MOE_LAYER_MS), (64, 0.0)):
        bare = est.pipeline(codes, 2).run(est.costs(n, 512), est.rho)[0]
        assert est.estimate(place, n, 512) == pytest.approx(bare + extra)


def test_prompt_tiers_mix_cpu_and_streamed_expert_groups_once_their_launches_are_few():
    """A GPU expert group in a step of many tokens runs in padded runs (`moe.experts_padded`: a dozen
    launches per run and two per routed expert, against seven per routed expert), and the estimator
    prices it so. On the H200 profile a Qwen3-30B-A3B group at 256 tokens was priced 1.9 ms of launches,
    above its 2.7 ms copy's share, and the tier-256 plan could not beat streaming every group; now its
    plan puts some groups on the CPU while others stream, and predicts at least 15% less time than
    streaming those too."""
    import dataclasses
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.estimator import Estimator

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24))
    group = next(i for i, s in enumerate(spec.sublayers) if s.kind == "experts")
    assert Estimator(spec, prof).costs(256, 256).gpu_ms[group] < 1.0
    for budget in (2 << 30, 4 << 30):
        ps = Planner(spec, prof).plan(budget, kv_tokens=4096)
        plan = ps.for_tokens(256)
        kinds = {p for n, p in plan.placement.items() if ".experts." in n}
        assert {Placement.CPU, Placement.STREAMED} <= kinds, budget
        every = {n: Placement.STREAMED if ".experts." in n and p is Placement.CPU else p
                 for n, p in plan.placement.items()}
        streamed = Estimator(spec, prof).estimate(every, 256, 256, plan.n_slots, plan.kv_layers)
        assert plan.predicted_ms < 0.85 * streamed, (plan.predicted_ms, streamed)


def test_moe_prompt_tiers_mix_cpu_groups_only_where_the_state_moves_pay():
    """On the H200 profile, the Qwen3-30B-A3B shape (24 layers) at the room of a 2 GiB budget: a
    1024-token step streams every expert group (call Z, session 12: mixing 64 CPU groups in took 766 ms
    against 557 streaming them all), while 64- and 256-token steps keep CPU groups among the streamed
    ones (call Q, session 11: 288-299 and 438-458 ms against 508-521). A MoE state moved between host and
    GPU is priced at its measured rate (`estimator.STATE_MOVE_GBPS`)."""
    import dataclasses
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    cfg = dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=24)
    ps = Planner(ModelSpec.from_config(cfg), prof).plan(1155530752, kv_tokens=4096)

    def cpu_groups(tier):
        return sum(1 for n, p in ps.for_tokens(tier).placement.items() if ".experts." in n and p is Placement.CPU)

    assert cpu_groups(1024) == 0
    assert cpu_groups(64) > 0 and cpu_groups(256) > 0


def test_a_paused_warm_prices_the_same_tables_in_small_blocks():
    """A background thread prices a KV capacity's tables with a pause between blocks (the engine waits
    there while steps run): the tables are the same as priced in one go, and the pauses split the work of
    Llama-3-8B's family into many blocks."""
    import numpy as np

    from engine.bench.shapes import get_shape

    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    whole, paused = (Planner(spec, SIM, one_slot_tiers=ONE_SLOT_TIERS) for _ in range(2))
    pauses = []
    whole.warm(4096)
    paused.warm(4096, lambda: pauses.append(1))
    assert whole.has_table(4096) and paused.has_table(4096)
    for a, b in zip(whole._tables[4096], paused._tables[4096]):
        assert np.array_equal(a, b)
    for a, b in zip(whole._one_slot_tables[4096], paused._one_slot_tables[4096]):
        assert np.array_equal(a, b)
    members, subs = paused.family.place.shape
    assert len(pauses) >= len(paused.tiers) * (members * subs // (1 << 17))
    assert len(pauses) > 10 * len(paused.tiers)


def test_a_plan_moved_to_the_cpu_takes_no_more_vram_and_is_priced_by_the_same_estimator():
    """`Planner.moved_to_cpu`: the named sub-layers computed on the CPU, the rest as planned; the KV of a
    layer whose attention moved stays in host memory, and the price is the estimator's for the new placement."""
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    planner = Planner(spec, prof, tiers=(1, 16))
    plan = planner.plan(6 * 2**30, kv_tokens=2048).for_tokens(1)
    assert any(plan.placement[f"layers.{i}.attn"] is not Placement.CPU for i in range(32))
    moved = planner.moved_to_cpu(plan, ("layers.*.attn", "head"))
    assert all(moved.placement[f"layers.{i}.attn"] is Placement.CPU for i in range(32))
    assert moved.placement["head"] is Placement.CPU
    assert all(moved.placement[n] == p for n, p in plan.placement.items() if n.endswith(".ffn"))
    assert moved.vram.total <= plan.vram.total and moved.vram.kv == 0
    assert all(not moved.kv_on_gpu(i) for i in range(32))
    assert moved.predicted_ms == pytest.approx(planner.estimate(moved, 1, planning_context(1, 2048)))
    assert moved.predicted_ms != pytest.approx(plan.predicted_ms)
    same = planner.moved_to_cpu(plan, ("nothing.*",))
    assert same.placement == plan.placement and same.predicted_ms == pytest.approx(plan.predicted_ms)


def test_a_kv_layers_entry_sets_a_plan_to_another_plans_placement_and_kv_exactly():
    """A "kv_layers=N" entry sets the GPU-resident KV prefix of a moved plan, capped at the layers that lead
    with their attention on the GPU: a plan with its attention moved to the CPU and back with its old prefix
    is the plan again (placement, KV, VRAM, price), where without the entry the returning attention reads its
    KV from host memory; a bad count fails with one line."""
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.errors import BadInputError
    from engine.sharding.planner import parse_move

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    planner = Planner(spec, prof, tiers=(1, 16))
    plan = planner.plan(6 * 2**30, kv_tokens=2048).for_tokens(1)
    on_gpu = [i for i in range(32) if plan.placement[f"layers.{i}.attn"] is not Placement.CPU]
    assert plan.kv_layers and on_gpu[:plan.kv_layers] == list(range(plan.kv_layers))
    away = planner.moved_to_cpu(plan, ("layers.*.attn",))
    assert away.kv_layers == 0
    back = [f"layers.{i}.attn={plan.placement[f'layers.{i}.attn'].value}" for i in on_gpu]
    without = planner.moved_to_cpu(away, tuple(back))
    assert without.placement == plan.placement and without.kv_layers == 0
    again = planner.moved_to_cpu(away, (*back, f"kv_layers={plan.kv_layers}"))
    assert again.placement == plan.placement and again.kv_layers == plan.kv_layers
    assert again.vram == plan.vram
    assert again.predicted_ms == pytest.approx(plan.predicted_ms)
    assert without.predicted_ms > again.predicted_ms
    capped = planner.moved_to_cpu(plan, ("layers.1.attn", "kv_layers=32"))
    assert capped.kv_layers == 1
    assert parse_move("kv_layers=4") == ("kv_layers", 4)
    with pytest.raises(BadInputError, match="kv_layers=N"):
        parse_move("kv_layers=all")


def test_a_plan_moved_to_the_gpu_is_priced_and_bad_entries_are_refused():
    """`Planner.moved_to_cpu` with "PATTERN=PLACE" entries: the head made resident and every attention
    streamed, the KV prefix kept (a streamed attention past it reads its KV from host memory), priced by the
    estimator; an entry naming no placement fails with one line."""
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.errors import BadInputError
    from engine.sharding.planner import parse_move

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    planner = Planner(spec, prof, tiers=(1, 16))
    plan = planner.plan(1100 * 2**20, kv_tokens=2048).for_tokens(1)     # (2 GiB less a CUDA context)
    assert plan.placement["head"] is Placement.CPU
    moved = planner.moved_to_cpu(plan, ("head=resident", "layers.*.attn=streamed", "layers.0.ffn"))
    assert moved.placement["head"] is Placement.RESIDENT
    assert all(moved.placement[f"layers.{i}.attn"] is Placement.STREAMED for i in range(32))
    assert moved.placement["layers.0.ffn"] is Placement.CPU
    assert moved.kv_layers == plan.kv_layers
    # (what leaves residency: attention now streamed, and layers.0.ffn where the plan kept it resident)
    left = [s for s in spec.sublayers if s.kind == "attn" or s.name == "layers.0.ffn"]
    was_res = sum(s.weight_bytes for s in left if plan.placement[s.name] is Placement.RESIDENT)
    assert moved.vram.weights >= plan.vram.weights - was_res + spec.by_name()["head"].weight_bytes
    assert moved.predicted_ms == pytest.approx(planner.estimate(moved, 1, planning_context(1, 2048)))
    assert parse_move("head=Streamed") == ("head", Placement.STREAMED)
    assert parse_move("layers.*.attn") == ("layers.*.attn", Placement.CPU)
    with pytest.raises(BadInputError, match="PLACE one of cpu, resident, streamed"):
        parse_move("head=gpu")


@pytest.mark.parametrize("budget_gib", [2, 4, 8])
def test_the_decode_tier_streams_through_one_slot_where_that_is_priced_faster(budget_gib):
    """On the H200 profile the Llama-3-8B decode plan streams through one slot and keeps the second slot's
    VRAM for weights, priced faster than the best two-slot plan by more than ONE_SLOT_MIN_GAIN; every larger
    tier keeps two slots (its copies wait for the compute that frees a slot); with no one-slot tiers every
    plan has two."""
    from pathlib import Path

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.planner import ONE_SLOT_MIN_GAIN

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    budget = budget_gib << 30
    one = Planner(spec, prof, tiers=(1, 4, 16, 512), one_slot_tiers=ONE_SLOT_TIERS).plan(budget, kv_tokens=4096)
    two = Planner(spec, prof, tiers=(1, 4, 16, 512)).plan(budget, kv_tokens=4096)
    assert [p.n_slots for p in two.plans] == [2, 2, 2, 2]
    assert [p.n_slots for p in one.plans] == [1, 2, 2, 2]
    decode = one.for_tokens(1)
    assert decode.predicted_ms < two.for_tokens(1).predicted_ms * (1 - ONE_SLOT_MIN_GAIN)
    assert decode.vram.slots < two.for_tokens(1).vram.slots <= 2 * decode.vram.slots
    assert decode.vram.weights > two.for_tokens(1).vram.weights
    assert all(p.vram.total <= budget for p in one.plans)
    assert [p.predicted_ms for p in one.plans[1:]] == [p.predicted_ms for p in two.plans[1:]]


def test_the_decode_tier_keeps_two_slots_where_one_would_slow_the_steps_that_share_its_plan(monkeypatch):
    """Steps of up to 16 tokens (verify steps, small batches) run on the decode plan: at 2 GiB the H200
    profile prices the Llama-3-8B one-slot decode plan faster for one token but slower for 16, so the planner
    keeps two slots there (the guard off, it takes one); at 4 GiB one slot is no slower at 16 tokens."""
    from pathlib import Path

    import engine.sharding.planner as planner_mod
    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    ctx16 = planning_context(16, 4096)

    def decode_plans(budget):
        planner = Planner(spec, prof, one_slot_tiers=ONE_SLOT_TIERS)
        return planner, planner.plan(budget, kv_tokens=4096).for_tokens(1), \
            Planner(spec, prof).plan(budget, kv_tokens=4096).for_tokens(1)
    planner, chosen, two = decode_plans(2 << 30)
    assert chosen.n_slots == 2 and chosen.placement == two.placement
    planner, chosen, two = decode_plans(4 << 30)
    assert chosen.n_slots == 1
    assert planner.estimate(chosen, 16, ctx16) <= planner.estimate(two, 16, ctx16) * 1.005
    monkeypatch.setattr(planner_mod, "ONE_SLOT_CHECK_TOKENS", 1)
    planner, unguarded, two = decode_plans(2 << 30)
    assert unguarded.n_slots == 1 and unguarded.predicted_ms < two.predicted_ms
    assert planner.estimate(unguarded, 16, ctx16) > planner.estimate(two, 16, ctx16) * 1.005


@pytest.mark.parametrize("budget_gib", [4, 8])
def test_with_transfer_coded_streams_the_decode_tier_keeps_two_slots(budget_gib):
    """With the streamed sub-layers transfer-coded (75.3% of their bytes, as the engine codes Llama-3-8B's
    random bf16 weights on the H200) the profile prices no one-slot decode plan faster, so even with one slot
    allowed the plans are the two-slot ones: why one slot is off by default."""
    from pathlib import Path

    from engine.bench.one_slot_plans import coded_like
    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file

    prof = profile_from_file(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")
    raw = ModelSpec.from_config(get_shape("llama3-8b"))
    spec = coded_like(raw, 0.7529)
    assert len(spec.transfer) == 65 and spec.stage_bytes > 0
    budget = budget_gib << 30
    allowed = Planner(spec, prof, one_slot_tiers=ONE_SLOT_TIERS).plan(budget, kv_tokens=2048)
    two = Planner(spec, prof).plan(budget, kv_tokens=2048)
    assert [p.n_slots for p in allowed.plans] == [2] * len(allowed.plans)
    assert [p.placement for p in allowed.plans] == [p.placement for p in two.plans]
    # (the same budget with raw streams does take one slot: the coding is what changes the choice)
    assert Planner(raw, prof, one_slot_tiers=ONE_SLOT_TIERS).plan(budget, kv_tokens=2048).for_tokens(1).n_slots == 1
