"""FP8 KV cache (e4m3, a scale per token and head): fewer bytes per token, close to the full cache."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.errors import BadInputError
from engine.sharding.memory import kv_cache_bytes
from engine.sharding.spec import ModelSpec
from tests.engine.tiny_plans import TIERS, slow_cpu_profile, third_of_weights

IDS = [(11 * i + 5) % 300 + 5 for i in range(120)]


def test_fp8_halves_a_16_bit_cache():
    from engine.bench.shapes import get_shape

    cfg = get_shape("llama3-8b")
    full = kv_cache_bytes(ModelSpec.from_config(cfg), 8192)
    fp8 = kv_cache_bytes(ModelSpec.from_config(cfg, kv_dtype="fp8"), 8192)
    assert fp8 / full == pytest.approx((128 + 4) / 256)       # 0.516: twice the context in the same VRAM


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_fp8_scores_stay_close_and_books_fewer_bytes(tiny_model, arch):
    path = tiny_model(arch)
    ref = engine.open_model(path, device="cpu", backend="torch").score(IDS)
    engines = {}
    for kv in (None, "fp8"):
        eng = engine.open_model(path, device="sim", backend="torch", tiers=TIERS, profile=slow_cpu_profile(),
                                kv_dtype=kv)
        eng.set_vram_budget(third_of_weights(eng) * 2)
        eng.force_plan("gpu_only")
        engines[kv] = (eng, eng.score(IDS))
    plain, fp8 = engines[None][1], engines["fp8"][1]
    assert (plain - ref).abs().max().item() < 1e-4            # the full cache is exact
    agree = (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert agree >= 0.9 and kl < 0.01, (agree, kl)
    assert 0 < engines["fp8"][0].accel.used["kv"] < engines[None][0].accel.used["kv"]
    assert engines["fp8"][0].accel.used["kv"] == kv_cache_bytes(engines["fp8"][0].spec, engines["fp8"][0].kv_tokens)


def test_fp8_greedy_generation_and_budget_moves(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="sim", backend="torch", kv_dtype="fp8")
    out = [e.token_id for e in eng.generate("a b c d", max_new_tokens=20)]
    eng.set_vram_budget(0)
    eng.set_vram_budget(eng.spec.total_weight_bytes * 4)
    assert [e.token_id for e in eng.generate("a b c d", max_new_tokens=20)] == out
    with pytest.raises(BadInputError):
        engine.open_model(tiny_model("llama"), device="sim", backend="torch", kv_dtype="int4")
