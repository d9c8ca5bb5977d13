"""Benchmark weights (`random_model`, the GGUF writer): a MoE shape's tokens spread over the experts at every
layer, as a trained model's do, instead of all routing to the same few (which would make prompts and
batches touch a small part of the expert weights and flatter every system's MoE figures)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from engine.bench.gguf_shapes import write_gguf
from engine.bench.moe_routing import count_routing, gguf_moe_shape
from engine.config import ModelConfig
from engine.loading.random_init import EMBED_STD, RESIDUAL_WRITE_STD, WEIGHT_STD, random_model, random_std

# A small qwen3_moe shape deep enough for the routing to collapse with every matrix at 0.02 (checked when
# this test was written: by its last layer the tokens then share a handful of experts).
CFG = ModelConfig(arch="qwen3_moe", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=8,
                  num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=4096, tie_word_embeddings=False, qk_norm=True, dtype="bfloat16",
                  num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128, norm_topk_prob=True)
TOKENS = 256


def _routing(eng, ids) -> list[collections.Counter]:
    """Each MoE layer's expert counts over one forward pass of `ids`; every layer routed once."""
    hits = count_routing(eng, ids, CFG.num_layers)
    assert [sum(c.values()) for c in hits] == [TOKENS * CFG.num_experts_per_tok] * CFG.num_layers
    return hits


def _assert_spread(hits: list[collections.Counter]) -> None:
    mean = TOKENS * CFG.num_experts_per_tok / CFG.num_experts          # 32 pairs an expert
    for layer, counts in enumerate(hits):
        assert len(counts) == CFG.num_experts, (layer, len(counts))     # every expert touched
        # Poisson(32) rarely passes 60; a collapsed layer gives some experts every token (256)
        assert max(counts.values()) < 2 * mean, (layer, counts.most_common(3))


def test_standard_deviations_by_name():
    assert random_std("embed.weight") == random_std("token_embd.weight") == EMBED_STD
    assert random_std("model.embed_tokens.weight") == EMBED_STD
    for name in ("layers.3.o.weight", "layers.3.down.weight", "layers.3.experts.7.down.weight",
                 "blk.2.attn_output.weight", "blk.2.ffn_down.weight", "blk.2.ffn_down_exps.weight",
                 "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.experts.down_proj"):
        assert random_std(name) == RESIDUAL_WRITE_STD, name
    for name in ("layers.3.q.weight", "layers.3.experts.7.gate.weight", "head.weight", "lm_head.weight",
                 "blk.2.ffn_gate_exps.weight", "layers.3.router.weight", "model.layers.0.mlp.experts.gate_up_proj"):
        assert random_std(name) == WEIGHT_STD, name


def test_random_model_routes_tokens_over_all_experts_at_every_layer():
    from engine.backends.torch_engine import TorchEngine

    eng = TorchEngine(random_model(CFG, seed=0), device="cpu", n_ctx=1024)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, TOKENS).tolist()
    try:
        _assert_spread(_routing(eng, ids))
    finally:
        eng.close()


@pytest.mark.slow
def test_gguf_writer_routes_tokens_over_all_experts_at_every_layer(tmp_path):
    """The file llama.cpp runs, read by the engine (which computes what llama.cpp computes from it: the tiny
    file's logits are compared with llama.cpp's in test_bench_llamacpp_moe)."""
    import engine

    facts = write_gguf(gguf_moe_shape(CFG), tmp_path / "moe.gguf", None, "f32")
    eng = engine.open_model(facts["path"], device="cpu", backend="torch")
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, TOKENS).tolist()
    try:
        _assert_spread(_routing(eng, ids))
    finally:
        eng.close()


def test_accelerate_model_draws_the_same_deviations_with_norms_at_one():
    transformers = pytest.importorskip("transformers")
    from engine.bench.accelerate_runs import build_model

    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2)
    model = build_model(cfg)
    for name, p in model.named_parameters():
        x = p.detach().float()
        if "norm" in name.rsplit(".", 2)[-2]:
            assert torch.equal(x, torch.ones_like(x)), name
        else:
            assert abs(x.std().item() / random_std(name) - 1) < 0.2, (name, x.std().item())


def test_moe_routing_bench_reports_both_weightings(tmp_path):
    """`engine.bench.moe_routing` (the record behind the benchmarks' note on MoE weights) on a small
    configuration: both weightings, every layer, the pairs of every token counted."""
    import json

    from engine.bench import moe_routing

    assert moe_routing.main(["--layers", "2", "--moe-intermediate", "16", "--vocab", "256", "--tokens", "32",
                             "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_routing.json").read_text())
    results = report["results"]
    assert set(results) == {"random_model, every matrix at 0.02", "random_model, random_std"}
    for rows in results.values():
        assert [r["layer"] for r in rows] == [0, 1]
        assert all(r["pairs"] == 32 * 8 and 0 < r["experts_touched"] <= 128 for r in rows)
    assert report["command"].startswith("python -m engine.bench.moe_routing")
