"""A profile moved to the rates measured now (`ProfileDatabase.at_rates`), and the engine doing so at open
(SLIPSTREAM_RATE_PROBE=1; off by default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from engine.bench.shapes import get_shape
from engine.commands.plan import profile_from_file
from engine.sharding.planner import Planner
from engine.sharding.profile import ProfileDatabase
from engine.sharding.spec import ModelSpec

H200 = Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json"
KEYS = ("cpu_gemv_gbps", "cpu_gemv_with_copy_gbps", "h2d_gbps", "h2d_with_cpu_gbps")


@pytest.fixture(scope="module")
def h200():
    return profile_from_file(H200)


def rates_of(prof, cpu=1.0, cpu_copy=1.0, h2d=1.0, h2d_cpu=1.0) -> dict:
    return dict(zip(KEYS, (prof.link[k] * f for k, f in zip(KEYS, (cpu, cpu_copy, h2d, h2d_cpu), strict=True)),
                    strict=True))


def test_the_profiles_own_rates_change_nothing(h200):
    same = h200.at_rates(rates_of(h200))
    assert same.data["rates_scaled"]["cpu"] == pytest.approx(1.0)
    for n in (1, 16, 1024):
        assert same.gemm_gflops("cpu", "bfloat16", "ffn", n) == pytest.approx(h200.gemm_gflops("cpu", "bfloat16", "ffn", n))
    assert same.copy_ms(1 << 30, busy=True) == pytest.approx(h200.copy_ms(1 << 30, busy=True))
    assert same.cpu_with_copy_factor == pytest.approx(h200.cpu_with_copy_factor)
    assert "rates_scaled" not in h200.data            # (the stored profile is left alone)


def test_each_rate_moves_its_own_prices(h200):
    moved = h200.at_rates(rates_of(h200, cpu=1.2, cpu_copy=1.5, h2d=0.9, h2d_cpu=0.8))
    assert moved.gemm_gflops("cpu", "bfloat16", "ffn", 1) == pytest.approx(1.2 * h200.gemm_gflops("cpu", "bfloat16", "ffn", 1))
    assert moved.gemm_gflops("cpu", "bfloat16", "attn", 64) == pytest.approx(
        1.2 * h200.gemm_gflops("cpu", "bfloat16", "attn", 64))
    assert moved.experts_gflops("bfloat16", 4) == pytest.approx(1.2 * h200.experts_gflops("bfloat16", 4))
    assert moved.attention_ms("cpu", "bfloat16", 1e9, 0) == pytest.approx(h200.attention_ms("cpu", "bfloat16", 1e9, 0) / 1.2)
    assert moved.cpu_wake_ms == pytest.approx(h200.cpu_wake_ms / 1.2)
    # the CPU beside copies: its absolute rate moves by 1.5, against a priced rate that moved by 1.2
    assert moved.cpu_with_copy_factor == pytest.approx(min(1.0, h200.cpu_with_copy_factor * 1.5 / 1.2))
    assert moved.copy_ms(1 << 30) == pytest.approx(h200.copy_ms(1 << 30) / 0.9)
    assert moved.copy_ms(1 << 30, busy=True) == pytest.approx(h200.copy_ms(1 << 30, busy=True) / 0.8)
    assert moved.data["rates_scaled"]["h2d_with_cpu"] == pytest.approx(0.8)


def test_factors_are_held_within_limits_and_missing_rates_keep_theirs(h200):
    wild = h200.at_rates(rates_of(h200, cpu=10.0, h2d=0.01))
    assert wild.data["rates_scaled"]["cpu"] == 2.0 and wild.data["rates_scaled"]["h2d"] == 0.5
    cpu_only = h200.at_rates({"cpu_gemv_gbps": h200.link["cpu_gemv_gbps"] * 1.1, "cpu_gemv_with_copy_gbps": None,
                              "h2d_gbps": None, "h2d_with_cpu_gbps": None})
    assert cpu_only.data["rates_scaled"]["h2d"] == 1.0
    assert cpu_only.copy_ms(1 << 30) == pytest.approx(h200.copy_ms(1 << 30))


def test_a_faster_cpu_moves_work_off_pcie_and_the_moved_plan_is_no_slower(h200):
    """The planner balances the CPU against PCIe: on a lease whose CPU reads 25% faster (session 18's call D
    against the profile), the 4 GiB Llama-3-8B decode plan streams fewer FFNs, and by the moved rates it is
    at least as fast as the stored rates' plan (the planner's choice is the best it priced)."""
    spec = ModelSpec.from_config(get_shape("llama3-8b"))
    budget = 3_275_751_424                         # the suite's bookable bytes at 4 GiB
    fast = h200.at_rates(rates_of(h200, cpu=1.14, cpu_copy=1.27))
    base_plan = Planner(spec, h200, tiers=(1,)).plan(budget, kv_tokens=2048).plans[0]
    fast_planner = Planner(spec, fast, tiers=(1,))
    fast_plan = fast_planner.plan(budget, kv_tokens=2048).plans[0]
    assert len(fast_plan.streamed()) < len(base_plan.streamed())
    assert fast_planner.estimate(fast_plan, 1, 100) <= fast_planner.estimate(base_plan, 1, 100)


def test_off_a_gpu_nothing_is_probed(tiny_model, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_RATE_PROBE", "1")
    calls = []
    monkeypatch.setattr("engine.sharding.measure_link.probe_rates", lambda *a, **k: calls.append(a) or {})
    eng = engine.open_model(tiny_model("qwen3"), device="sim", backend="torch")
    try:
        eng.set_vram_budget(eng.spec.total_weight_bytes)
        assert eng.rate_probe is None and eng.plan_report()["rate_probe"] is None
        assert calls == []                              # (no PCIe link to measure)
    finally:
        eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_plans_come_from_the_rates_measured_at_open(tiny_model, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_RATE_PROBE", "1")
    eng = engine.open_model(tiny_model("qwen3"), device="cuda", backend="torch", vram_budget="1GiB")
    try:
        probe = eng.plan_report()["rate_probe"]
        assert probe and "error" not in probe and 0.5 <= probe["cpu"] <= 2.0 and 0.5 <= probe["h2d"] <= 2.0
        assert eng.planner().prof.data["rates_scaled"]["cpu"] == probe["cpu"]
    finally:
        eng.close()
    given = ProfileDatabase.for_device("cuda")
    eng = engine.open_model(tiny_model("qwen3"), device="cuda", backend="torch", vram_budget="1GiB", profile=given)
    try:
        assert eng.rate_probe is None and eng.planner().prof is given
    finally:
        eng.close()
