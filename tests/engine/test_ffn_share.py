"""A streamed dense FFN's rows split between the CPU and the GPU (`Plan.ffn_cpu_rows`).

The executor copies only the GPU's rows of gate and up into the slot, computes the last rows on the host
and joins them before the down projection; the tokens are those of the whole FFN. The planner gives the
CPU such a share where the estimator predicts it faster.
"""

from __future__ import annotations

import itertools
import os
import random
from pathlib import Path

import pytest

import engine
from engine.errors import BadInputError
from engine.sharding.plan import Placement, Plan, PlanSet
from tests.engine.tiny_plans import all_cpu_planset, force_planset, plain_on_gpu

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
TOL = 1e-5 if DEVICE == "sim" else 1e-3
ARCHS = ["llama3", "qwen2", "qwen3"]


def shared_planset(eng, rows: int, n_slots: int = 2, attn: Placement = Placement.CPU) -> PlanSet:
    """Attention as given, every FFN streamed with `rows` of its rows on the CPU, the head resident."""
    placement = {s.name: (Placement.STREAMED if s.kind == "ffn" else attn if s.kind == "attn"
                          else Placement.RESIDENT if s.kind == "head" else Placement.CPU)
                 for s in eng.spec.sublayers}
    return PlanSet(eng.budget, [Plan(t, "manual", dict(placement), n_slots, ffn_cpu_rows=rows) for t in eng.tiers])



@pytest.fixture(autouse=True)
def no_planner(monkeypatch):
    from engine.backends.torch_engine import TorchEngine

    monkeypatch.setattr(TorchEngine, "_make_planset", all_cpu_planset)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", [Placement.CPU, Placement.RESIDENT])
def test_shared_rows_give_the_whole_ffns_logits(tiny_model, arch, attn):
    path = tiny_model(arch)
    cpu = engine.open_model(path, device="cpu", backend="torch")
    ids = list(range(5, 60))
    ref = cpu.score(ids)
    cpu.close()
    eng = engine.open_model(path, device=DEVICE, backend="torch", **plain_on_gpu(DEVICE), vram_budget="1GiB")
    inter = eng.config.intermediate_size
    for rows in (16, inter // 2, inter - 16, inter):
        force_planset(eng, shared_planset(eng, rows, attn=attn))
        got = eng.score(ids)
        assert ((got - ref).abs().max() / ref.abs().max()).item() < TOL, rows
    eng.close()


def test_a_share_copies_only_the_gpus_rows(tiny_model):
    eng = engine.open_model(tiny_model("llama3"), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    cfg, ex = eng.config, eng.executor
    n_ffn = cfg.num_layers
    up = ex.store.sublayers["layers.0.ffn"].host_views["up.weight"]
    row_bytes = up.shape[1] * up.element_size()       # a row of gate or up
    copied = {}
    for rows in (0, 48):
        force_planset(eng, shared_planset(eng, rows, n_slots=1))     # one slot: every FFN is copied every step
        eng.score([1, 2, 3])                                  # (the first step after a switch primes)
        before = ex.copied_bytes
        eng.score([4, 5, 6])
        copied[rows] = ex.copied_bytes - before
    assert copied[0] - copied[48] == n_ffn * 2 * 48 * row_bytes
    assert eng.accel.used["slots"] == max(ex.store.nbytes(f"layers.{i}.ffn") for i in range(n_ffn))
    eng.close()


@pytest.mark.parametrize("n_slots", [1, 4])
def test_shares_changing_mid_generation_keep_the_tokens(tiny_model, n_slots):
    """With four slots every FFN keeps its slot across steps: a slot copied for a larger share must be
    topped up when a smaller one comes in, and one copied whole serves any share."""
    path = tiny_model("qwen3")
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("the quick brown fox", max_new_tokens=24)]
    cpu.close()
    eng = engine.open_model(path, device=DEVICE, backend="torch", **plain_on_gpu(DEVICE), vram_budget="1GiB")
    inter = eng.config.intermediate_size
    rng = random.Random(3)
    force_planset(eng, shared_planset(eng, inter // 2, n_slots))
    got = []
    for i, ev in enumerate(eng.generate("the quick brown fox", max_new_tokens=24)):
        got.append(ev.token_id)
        if i % 4 == 1:
            force_planset(eng, shared_planset(eng, rng.choice([0, 16, inter // 4, inter]), n_slots))
    assert got == want
    assert eng.accel.total_used <= eng.budget
    eng.close()


def test_the_share_off_runs_whole_ffns(tiny_model):
    eng = engine.open_model(tiny_model("llama3"), device=DEVICE, backend="torch",
                            **plain_on_gpu(DEVICE), vram_budget="1GiB")
    force_planset(eng, shared_planset(eng, 32, n_slots=1))
    eng.executor.ffn_share = False
    eng.score([1, 2, 3])
    before = eng.executor.copied_bytes
    eng.score([4, 5, 6])
    assert eng.executor.copied_bytes - before == sum(eng.executor.store.nbytes(f"layers.{i}.ffn")
                                                      for i in range(eng.config.num_layers))
    eng.close()


# ---- the planner and the estimator -------------------------------------------------------------------

H200 = Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json"


@pytest.fixture(scope="module")
def llama_planners():
    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.planner import Planner
    from engine.sharding.spec import ModelSpec

    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    prof = profile_from_file(H200)
    return spec, Planner(spec, prof, ffn_share=True), Planner(spec, prof)


@pytest.mark.parametrize("budget", ["2GiB", "4GiB", "8GiB"])
def test_the_planner_shares_rows_only_where_predicted_faster(llama_planners, budget):
    """On the H200 profile the Llama-3-8B shape's prompt tiers of 64-1024 tokens stream more FFNs with a share
    on the CPU, predicted faster; no tier is predicted slower, every plan fits, and the shares are whole
    multiples of 16 rows."""
    from engine.sharding.planner import SHARE_MIN_GAIN, SHARE_ROW_ALIGN
    from engine.units import parse_bytes

    spec, with_share, without = llama_planners
    a, b = with_share.plan(budget), without.plan(budget)
    inter = spec.config.intermediate_size
    gained = 0
    for p, q in zip(a.plans, b.plans):
        assert p.vram.total <= parse_bytes(budget)
        assert p.predicted_ms <= q.predicted_ms
        assert p.ffn_cpu_rows % SHARE_ROW_ALIGN == 0 and 0 <= p.ffn_cpu_rows <= inter
        if p.ffn_cpu_rows:
            assert p.predicted_ms < q.predicted_ms * (1 - SHARE_MIN_GAIN)
            assert any(p.placement[s.name] is Placement.STREAMED for s in spec.sublayers if s.kind == "ffn")
            assert p.kv_layers == q.kv_layers and p.placement["head"] == q.placement["head"]
            assert with_share.estimate(p, p.tier, max(p.tier, p.kv_tokens // 2)) \
                == pytest.approx(p.predicted_ms, rel=1e-6)
            gained += 1
        else:
            assert p.predicted_ms == q.predicted_ms
    assert gained >= 2
    rep = a.report()["tiers"]
    assert [t.get("ffn_cpu_rows", 0) for t in rep] == [p.ffn_cpu_rows for p in a.plans]


def test_a_share_on_an_idle_cpu_is_predicted_faster(llama_planners):
    """Every FFN streamed and the attention on the GPU (a copy-bound step whose host waits): moving a share
    of the rows to the CPU shortens the copies more than it adds host work, up to a balance past which the
    host is the bottleneck."""
    spec, planner, _ = llama_planners
    est = planner.estimator
    placement = {s.name: (Placement.CPU if s.kind == "embed" else Placement.RESIDENT if s.kind == "attn"
                          else Placement.STREAMED) for s in spec.sublayers}
    inter = spec.config.intermediate_size
    ms = [est.estimate(placement, 1, 2048, 2, None, inter * j // 16) for j in range(17)]
    best = ms.index(min(ms))
    assert 0 < best < 16
    assert all(a > b for a, b in itertools.pairwise(ms[:best + 1]))
    assert all(a < b for a, b in itertools.pairwise(ms[best:]))
    assert est.estimate(placement, 1, 2048, 2, None, 0) == est.estimate(placement, 1, 2048, 2, None)


def test_a_moe_model_gets_no_share():
    import dataclasses

    from engine.bench.shapes import get_shape
    from engine.commands.plan import profile_from_file
    from engine.sharding.planner import Planner
    from engine.sharding.spec import ModelSpec

    spec = ModelSpec.from_config(dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=8))
    planset = Planner(spec, profile_from_file(H200), ffn_share=True).plan("4GiB")
    assert all(p.ffn_cpu_rows == 0 for p in planset.plans)


def test_the_engine_switch_forces_or_drops_the_share(tiny_model, monkeypatch):
    """`TorchEngine.ffn_share`: N rows in every plan that streams a dense FFN, False none, True the
    planner's choice, with the tokens of the CPU engine each time."""
    from engine.backends.torch_engine import TorchEngine
    from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

    monkeypatch.undo()            # (this test plans for real)
    path = tiny_model("llama3")
    cpu = engine.open_model(path, device="cpu", backend="torch")
    want = [e.token_id for e in cpu.generate("a share of the rows", max_new_tokens=12)]
    cpu.close()
    eng = TorchEngine(path, device=DEVICE,
                      **plain_on_gpu(DEVICE), vram_budget="1GiB", tiers=TIERS, profile=slow_cpu_profile())
    eng.set_vram_budget(third_of_weights(eng))
    assert any(p.placement[f"layers.{i}.ffn"] is Placement.STREAMED
               for p in eng.planset.plans for i in range(eng.config.num_layers))
    for setting in (32, False, True):
        eng.ffn_share(setting)
        for p in eng.planset.plans:
            streams_ffn = any(p.placement[f"layers.{i}.ffn"] is Placement.STREAMED
                              for i in range(eng.config.num_layers))
            if setting is False:
                assert p.ffn_cpu_rows == 0
            elif setting is not True:
                assert p.ffn_cpu_rows == (32 if streams_ffn else 0)
        assert eng.executor.ffn_share is (setting is not False)
        got = [e.token_id for e in eng.generate("a share of the rows", max_new_tokens=12)]
        assert got == want, setting
        assert eng.accel.total_used <= eng.budget
    with pytest.raises(BadInputError):
        eng.ffn_share(-1)
    eng.close()


def test_plans_carry_no_share_by_default(llama_planners):
    """Off by default (measured slower on the H200): neither the planner nor the engine's plans give the CPU
    a share unless asked."""
    from engine.sharding.planner import Planner

    spec, with_share, _ = llama_planners
    assert all(p.ffn_cpu_rows == 0 for p in Planner(spec, with_share.prof).plan("4GiB").plans)
