"""The physical bound's arithmetic (engine.bench.bound) on hand-checkable numbers and the real shapes."""

from __future__ import annotations

import pytest

from engine.bench.bound import Rates, ShapeBytes, bound_row, decode_bound_tps, prefill_bound_tps, shape_bytes
from engine.bench.gguf_shapes import gguf_shape

GB = 1e9
RATES = Rates(cpu_gbps=60.0, pcie_gbps=50.0, cpu_alone_gbps=70.0, pcie_alone_gbps=55.0, hbm_gbps=4000.0,
              gpu_tflops=700.0, cpu_tflops=0.0)


def _dense(total: float) -> ShapeBytes:
    return ShapeBytes(always=int(total), experts=0, active_fraction=1.0, kv_per_token=0,
                      flops_per_token=int(total), attn_flops_per_token_ctx=0)


def test_decode_bound_is_off_bytes_over_both_paths_plus_resident_over_hbm():
    sb = _dense(15 * GB)
    t = (15 * GB - 4 * GB) / (110 * GB) + 4 * GB / (4000 * GB)
    assert decode_bound_tps(sb, int(4 * GB), RATES) == pytest.approx(1 / t)
    t_alone = (11 * GB) / (125 * GB) + 4 * GB / (4000 * GB)
    assert decode_bound_tps(sb, int(4 * GB), RATES, alone=True) == pytest.approx(1 / t_alone)
    assert decode_bound_tps(sb, int(20 * GB), RATES) == pytest.approx(4000 / 15)   # all resident: HBM-bound


def test_decode_bound_of_moe_reads_only_routed_experts_and_keeps_attention_first():
    sb = ShapeBytes(always=2 * GB, experts=28 * GB, active_fraction=0.0625, kv_per_token=0,
                    flops_per_token=0, attn_flops_per_token_ctx=0)
    off_read = 0.0625 * (28 * GB - 1 * GB)                 # 3 GB budget: 2 GB always-read, 1 GB of experts
    res_read = 2 * GB + 0.0625 * 1 * GB
    assert decode_bound_tps(sb, int(3 * GB), RATES) == pytest.approx(1 / (off_read / 110e9 + res_read / 4000e9))


def test_prefill_bound_is_pcie_or_gpu_compute_whichever_is_slower():
    sb = _dense(15 * GB)
    # 13 GB off the GPU over 50 GB/s for a 512-token pass; compute 2*7.5e9*512 FLOPs is far less
    assert prefill_bound_tps(sb, int(2 * GB), RATES, 512) == pytest.approx(512 / (13 * GB / 50e9))
    tiny = _dense(1 * GB)
    flops = tiny.flops_per_token * 4096
    assert prefill_bound_tps(tiny, int(8 * GB), RATES, 4096) == pytest.approx(4096 / (flops / 700e12))
    with_cpu = Rates(**{**RATES.__dict__, "cpu_tflops": 5.0})
    assert prefill_bound_tps(sb, int(2 * GB), with_cpu, 512) > prefill_bound_tps(sb, int(2 * GB), RATES, 512)


def test_real_shapes_and_rows():
    llama = shape_bytes(gguf_shape("llama3-8b"))
    assert 14.9 * GB < llama.total < 15.2 * GB and llama.active_fraction == 1.0
    moe = shape_bytes(gguf_shape("qwen3-30b-a3b", 24))
    assert 30 * GB < moe.total < 31 * GB and moe.active_fraction == 8 / 128
    row = bound_row("llama3-8b", gguf_shape("llama3-8b"), "4GiB", 4 << 30, RATES)
    assert row["system"] == "bound" and row["budget"] == "4GiB" and row["peak_vram_bytes"] == 4 << 30
    assert 8 < row["decode_tps"] < row["decode_tps_rates_alone"] < 14
    assert row["prefill4096_tps"] > row["prefill512_tps"] > 0
    b2 = bound_row("qwen3-30b-a3b", gguf_shape("qwen3-30b-a3b", 24), "2GiB", 2 << 30, RATES)["decode_tps"]
    assert 50 < b2 < 80                                     # the anchors' ~60 tokens/s estimate


def test_prefill_bound_of_moe_computes_experts_on_the_cpu_at_their_active_share():
    """A token uses k/E of the experts, so the CPU computes an expert byte 1/fraction times cheaper than a
    dense one: the CPU's share of a MoE prefill grows, the more so the shorter the prompt."""
    with_cpu = Rates(**{**RATES.__dict__, "cpu_tflops": 4.0})
    moe = ShapeBytes(always=2 * GB, experts=28 * GB, active_fraction=0.0625, kv_per_token=0,
                     flops_per_token=0, attn_flops_per_token_ctx=0)
    dense_same = _dense(30 * GB)
    # 4 GB budget: always-read bytes resident, 26 GB of experts off; CPU 4e12 / (512 x 0.0625) = 125 GB/s
    assert prefill_bound_tps(moe, int(4 * GB), with_cpu, 512) == pytest.approx(512 / (26 * GB / (50e9 + 125e9)))
    assert prefill_bound_tps(dense_same, int(4 * GB), with_cpu, 512) == pytest.approx(
        512 / (26 * GB / (50e9 + 4e12 / 512)))
    # no CPU rate: the same PCIe bound as a dense shape of the same bytes
    assert prefill_bound_tps(moe, int(4 * GB), RATES, 4096) == pytest.approx(
        prefill_bound_tps(dense_same, int(4 * GB), RATES, 4096))


def test_the_coded_bound_moves_fewer_bytes_over_pcie():
    sb = _dense(15 * GB)
    # prefill: 13 GB of weights off the GPU, PCIe carrying 3/4 of their bytes
    assert prefill_bound_tps(sb, int(2 * GB), RATES, 512, coded_fraction=0.75) == \
        pytest.approx(512 / (0.75 * 13 * GB / 50e9))
    # decode: PCIe delivers 50 / 0.75 GB/s of weights beside the CPU's 60
    t = 11 * GB / ((60 + 50 / 0.75) * GB) + 4 * GB / (4000 * GB)
    assert decode_bound_tps(sb, int(4 * GB), RATES, coded_fraction=0.75) == pytest.approx(1 / t)
    row = bound_row("llama3-8b", gguf_shape("llama3-8b"), "4GiB", 4 << 30, RATES)
    assert row["prefill512_tps_coded"] > row["prefill512_tps"] and row["decode_tps_coded"] > row["decode_tps"]
