"""The estimator models the executor's pipeline: check it against hand-computed schedules."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.bench.shapes import get_shape
from engine.models.moe import FEW_TOKENS
from engine.sharding.estimator import Estimator
from engine.sharding.plan import Placement
from engine.sharding.profile import ProfileDatabase, sim_profile_dict
from engine.sharding.spec import ModelSpec, routed_streaming
from tests.engine.planner_cases import model_configs

SIM = ProfileDatabase.sim()
R, S, C = Placement.RESIDENT, Placement.STREAMED, Placement.CPU


def placement(spec, rule) -> dict:
    return {s.name: rule(s) for s in spec.sublayers}


@pytest.fixture(scope="module")
def llama():
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    return spec, Estimator(spec, SIM)


def test_all_resident_is_the_sum_of_gpu_costs(llama):
    spec, est = llama
    c = est.costs(1, 2048)
    expect = c.to_gpu_ms[0] + c.gpu_ms.sum() + c.out_ms
    assert est.estimate(placement(spec, lambda s: R), 1, 2048) == pytest.approx(expect)


def test_all_cpu_is_the_sum_of_cpu_costs(llama):
    spec, est = llama
    c = est.costs(16, 2048)
    assert est.estimate(placement(spec, lambda s: C), 16, 2048) == pytest.approx(c.cpu_ms.sum())


def test_few_streamed_sub_layers_keep_their_slots(llama):
    """With no more streamed sub-layers than slots, each is copied once and then stays: steady state
    costs what resident costs, plus the host's bookkeeping per streamed sub-layer."""
    spec, est = llama
    two = {"layers.3.ffn", "layers.9.ffn"}
    pl = placement(spec, lambda s: S if s.name in two else R)
    resident = est.estimate(placement(spec, lambda s: R), 1, 512)
    assert est.estimate(pl, 1, 512, n_slots=2) == pytest.approx(resident + 2 * est.costs(1, 512).stream_ms)
    assert est.estimate(pl, 1, 512, n_slots=1) > est.estimate(pl, 1, 512, n_slots=2)


def test_a_schedule_priced_with_other_slots_is_that_schedule_built_for_them(llama):
    """`Pipeline.with_slots(n)` (the planner prices its one-slot decode column on the two-slot structure)
    replays what a structure built for n slots replays, for random placements and step sizes."""
    spec, est = llama
    rng = random.Random(3)
    rows = np.array([[rng.choice((0, 1, 2, 3)) for _ in spec.sublayers] for _ in range(40)], dtype=np.int8)
    rows[:, 0] = 0                                      # (the embedding gathered on the CPU)
    for tokens in (1, 16, 512):
        c = est.costs(tokens, 2048)
        for n in (1, 2, 3):
            want = est.pipeline(rows, n).run(c, est.rho)
            assert np.array_equal(est.pipeline(rows, 2).with_slots(n).run(c, est.rho), want)
            assert np.array_equal(est.pipeline(rows, 3).with_slots(n).run(c, est.rho), want)


def test_all_streamed_decode_is_bound_by_the_copies(llama):
    spec, est = llama
    pl = placement(spec, lambda s: R if s.kind == "embed" else S)
    copies = sum(est.copy_alone[i] for i, s in enumerate(spec.sublayers) if s.kind != "embed")
    t = est.estimate(pl, 1, 512)
    assert copies <= t <= copies * 1.05 + 0.1


def test_cpu_and_copies_overlap(llama):
    """FFNs on the CPU while the next attention streams: the step takes less than CPU + copy time, at
    least the longer of the two, and more when the CPU slows down beside copies."""
    spec, est = llama
    pl = placement(spec, lambda s: S if s.kind == "attn" else C)
    c = est.costs(1, 512)
    cpu = sum(c.cpu_ms[i] for i, s in enumerate(spec.sublayers) if s.kind != "attn")
    copy = sum(est.copy_busy[i] for i, s in enumerate(spec.sublayers) if s.kind == "attn")
    t = est.estimate(pl, 1, 512)
    assert max(cpu, copy) <= t < cpu + copy
    data = sim_profile_dict()
    data["link"]["cpu_with_copy_factor"] = 1.0
    free = Estimator(spec, ProfileDatabase(data)).estimate(pl, 1, 512)
    assert free < t


def test_device_changes_cost_moves(llama):
    spec, est = llama
    alternating = placement(spec, lambda s: R if s.kind == "attn" else C)
    c = est.costs(1, 512)
    plain = sum(c.gpu_ms[i] if s.kind == "attn" else c.cpu_ms[i] for i, s in enumerate(spec.sublayers))
    moves = 32 * (c.to_gpu_ms[1] + c.to_cpu_ms)
    assert est.estimate(alternating, 1, 512) == pytest.approx(plain + moves)


def test_longer_context_costs_more_attention(llama):
    spec, est = llama
    pl = placement(spec, lambda s: C)
    assert est.estimate(pl, 1, 8192) > est.estimate(pl, 1, 1024)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=model_configs(), seed=st.integers(0, 10**6), n_slots=st.integers(1, 3))
def test_more_tokens_never_cheaper_per_step(cfg, seed, n_slots):
    spec = ModelSpec.from_config(cfg)
    est = Estimator(spec, SIM)
    rng = random.Random(seed)
    pl = placement(spec, lambda s: rng.choice([R, S, C]))
    ns = (1, 2, 4, 16, 64, 256, 1024, 4096)
    times = [est.estimate(pl, n, 4096, n_slots) for n in ns]
    # Within one way of streaming experts. Where a MoE step switches from routed streaming (copy only the
    # routed experts, after the router) to whole-group copies (prefetched ahead), a bigger step can be a
    # little cheaper: the copies no longer wait for the router. And between two steps that both run GPU
    # expert groups in padded runs (more than moe.FEW_TOKENS tokens, whole groups), the bigger one can
    # need fewer runs (a run holds up to the step's token count of rows): fewer launches. And a MoE layer
    # partly in VRAM costs its general path's sync and launches (PARTIAL_MOE_LAYER_MS) only in steps of up to
    # moe.FEW_TOKENS tokens, where whole layers run as one call: past that, every layer runs the general path.
    def padded(n):
        return cfg.is_moe and n > FEW_TOKENS and not routed_streaming(cfg, n)

    def few(n):
        return cfg.is_moe and n <= FEW_TOKENS
    same = [routed_streaming(cfg, a) == routed_streaming(cfg, b) and not (padded(a) and padded(b))
            and few(a) == few(b) for a, b in itertools.pairwise(ns)]
    assert all(b >= a * (1 - 1e-12) for (a, b), s in zip(itertools.pairwise(times), same) if s), times
    assert all(np.isfinite(times))


def test_batch_and_single_estimates_agree(llama):
    spec, est = llama
    rng = random.Random(1)
    rows = [{s.name: rng.choice([R, S, C]) for s in spec.sublayers} for _ in range(20)]
    batch = est.simulate(np.stack([est.encode(r) for r in rows]), 64, 1024, 2)
    assert batch == pytest.approx([est.estimate(r, 64, 1024) for r in rows])


def test_attention_over_host_kv_also_copies_the_kv(llama):
    """All streamed: with every layer's KV in host memory (kv_layers=0) the copy engine also brings each
    layer's keys and values for the step's context in and the new ones out, so the step, bound by the
    copies, costs that much more, and more at a longer context."""
    spec, est = llama
    pl = placement(spec, lambda s: R if s.kind == "embed" else S)
    per_token = next(s.kv_bytes_per_token for s in spec.sublayers if s.kind == "attn")
    for n, ctx in ((1, 512), (1, 4096), (64, 4096)):
        extra = est.estimate(pl, n, ctx, kv_layers=0) - est.estimate(pl, n, ctx)
        kv_ms = spec.config.num_layers * SIM.copy_ms((ctx + n) * per_token)
        assert extra == pytest.approx(kv_ms, rel=0.05)
    assert est.encode(pl, kv_layers=4)[[i for i, s in enumerate(spec.sublayers) if s.kind == "attn"]].tolist() \
        == [2] * 4 + [3] * (spec.config.num_layers - 4)


def test_cpu_attention_is_priced_with_the_attention_block_factor(llama):
    """A profile with `attn_block_factor` scales the CPU attention sub-layers' projections by it (higher or
    lower), leaving every FFN, the head and the GPU side as they were; one without it scales them by the
    FFN block factor exactly as before."""
    from engine.sharding.estimator import NATIVE_CALLS, OPS, attention_parts_ms, step_costs

    spec, _ = llama
    raw = ProfileDatabase(sim_profile_dict())

    def prof(attn_factor=None):
        data = sim_profile_dict()
        data["cpu"]["block_factor"] = {"1": 1.5, "1024": 1.0}
        if attn_factor is not None:
            data["cpu"]["attn_block_factor"] = {"1": attn_factor, "16": attn_factor}
        return ProfileDatabase(data)

    kinds = np.array([s.kind for s in spec.sublayers])
    attn, other = kinds == "attn", kinds != "attn"
    sub = spec.sublayers[int(np.argmax(attn))]
    proj, over_ctx = attention_parts_ms(raw, "cpu", "bfloat16", sub, 1, 2048)
    ops = raw.op_ms("cpu", OPS["cpu"]["attn"]) + NATIVE_CALLS["attn"] * raw.native_call_ms
    ffn_only = step_costs(spec, prof(), 1, 2048)
    assert ffn_only.cpu_ms[attn] == pytest.approx(1.5 * proj + over_ctx + ops)     # as before: the FFN factor
    for f in (2.0, 0.75):
        c = step_costs(spec, prof(f), 1, 2048)
        assert c.cpu_ms[attn] == pytest.approx(f * proj + over_ctx + ops)
        assert (c.cpu_ms[other] == ffn_only.cpu_ms[other]).all() and (c.gpu_ms == ffn_only.gpu_ms).all()
    assert (step_costs(spec, prof(2.0), 1, 2048).cpu_ms[attn] > ffn_only.cpu_ms[attn]).all()
    assert (step_costs(spec, prof(0.75), 1, 2048).cpu_ms[attn] < ffn_only.cpu_ms[attn]).all()
    # and a plan with CPU attention costs more under the larger factor
    cpu_attn = placement(spec, lambda s: C if s.kind == "attn" else R)
    assert Estimator(spec, prof(2.0)).estimate(cpu_attn, 1, 2048) > Estimator(spec, prof()).estimate(cpu_attn, 1, 2048)


def test_native_calls_and_qk_norms_are_priced_on_their_side(llama):
    """A profile's `native_call_us` adds each CPU sub-layer's native kernel calls (4 per attention, 3 per
    FFN, 2 for the head) and nothing on the GPU; q/k norms add GPU ops to an attention."""
    from engine.sharding.estimator import NATIVE_CALLS, OPS, QK_NORM_OPS, step_costs

    spec, _ = llama
    data = sim_profile_dict()
    data["cpu"]["native_call_us"] = 50.0
    base, called = step_costs(spec, ProfileDatabase(sim_profile_dict()), 1, 512), step_costs(spec, ProfileDatabase(data), 1, 512)
    for i, s in enumerate(spec.sublayers):
        assert called.cpu_ms[i] - base.cpu_ms[i] == pytest.approx(NATIVE_CALLS[s.kind] * 0.05)
    assert (called.gpu_ms == base.gpu_ms).all()
    qwen = ModelSpec.from_config(get_shape("qwen3-8b"))
    assert qwen.config.qk_norm and not spec.config.qk_norm
    prof = ProfileDatabase(sim_profile_dict())
    c = step_costs(qwen, prof, 1, 512)
    attn = next(i for i, s in enumerate(qwen.sublayers) if s.kind == "attn")
    assert c.gpu_ms[attn] >= prof.op_ms("gpu", OPS["gpu"]["attn"] + QK_NORM_OPS["gpu"])


def test_the_profiler_measures_a_native_call():
    from engine import kernels
    from engine.sharding.measure import native_call_us

    us = native_call_us()
    if kernels._load() is None:
        assert us == 0.0
    else:
        assert 0.1 < us < 5000


def test_cpu_expert_groups_of_a_prompt_are_priced_from_the_expert_job_table():
    """With the profile's expert-job table, a step's CPU expert groups are priced at its rate for their
    rows per expert and a fixed number of ops (one native job per projection); without it, or past the
    rows it measured (no tiles: the engine goes expert by expert), as before."""
    from engine.sharding.estimator import (
        BULK_HIDDEN_PASSES,
        BULK_INTER_PASSES,
        NATIVE_CALLS_EXPERTS_PER_LAYER,
        OPS,
        OPS_BULK_GROUP,
        step_costs,
    )

    spec = ModelSpec.from_config(get_shape("qwen3-30b-a3b"))
    cfg = spec.config
    group = next(i for i, s in enumerate(spec.sublayers) if s.kind == "experts")
    sub = spec.sublayers[group]
    data = sim_profile_dict()
    base = ProfileDatabase(sim_profile_dict())
    data["cpu"]["experts"] = {"bfloat16": [[1, 50.0], [16, 400.0], [64, 2000.0]]}
    prof = ProfileDatabase(data)
    for n, bulk in ((16, True), (256, True), (1024, False)):
        touched = spec.expected_experts(sub, n)
        rows = n * cfg.num_experts_per_tok * sub.n_experts / cfg.num_experts / touched
        flops = touched * rows * 6 * cfg.hidden_size * cfg.moe_intermediate_size
        got = step_costs(spec, prof, n, n).cpu_ms[group]
        old = step_costs(spec, base, n, n).cpu_ms[group]
        if bulk:
            rate = prof.experts_gflops("bfloat16", rows)
            issue = (prof.op_ms("cpu", OPS["cpu"]["experts"] + OPS_BULK_GROUP)
                     + NATIVE_CALLS_EXPERTS_PER_LAYER / len(cfg.expert_groups()) * prof.native_call_ms)
            assert 50.0 <= rate <= 2000.0
            moved = prof.mem_ms("cpu", touched * rows * 2 * (BULK_HIDDEN_PASSES * cfg.hidden_size
                                                             + BULK_INTER_PASSES * cfg.moe_intermediate_size))
            assert got == pytest.approx(flops / (rate * 1e6) + moved + issue)
            assert got < old, n
        else:
            assert got == old, n
    assert prof.experts_gflops("bfloat16", 65) is None and prof.experts_gflops("float16", 4) is None
    assert prof.experts_gflops("bfloat16", 32) == pytest.approx(2000.0 * 32 / 64, rel=0.3)
