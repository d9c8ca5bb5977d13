"""Budget math: the planner's byte counts are the executor's."""

from __future__ import annotations

import torch
from hypothesis import given, settings

from engine.sharding import memory
from engine.sharding.plan import Placement
from engine.sharding.spec import ModelSpec
from tests.engine.planner_cases import model_configs

_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_constants_match_the_executor():
    from engine.sharding import kvcache, weights

    assert memory.TENSOR_ALIGN == weights._ALIGN
    assert memory.KV_BLOCK == kvcache.BLOCK_SIZE


@settings(max_examples=15, deadline=None)
@given(cfg=model_configs())
def test_sublayer_bytes_are_the_packed_buffer_sizes(cfg):
    from engine.config import weight_names
    from engine.sharding.weights import SubLayerWeights

    spec = ModelSpec.from_config(cfg)
    shapes = memory.tensor_shapes(cfg)
    sizes = memory.sublayer_bytes(spec)
    for sub, names in weight_names(cfg).items():
        if sub in ("embed", "head") and cfg.vocab_size * cfg.hidden_size > 1 << 22:
            continue   # skip allocating big vocabularies; the arithmetic is the same
        tensors = {n: torch.empty(shapes[n], dtype=_TORCH[cfg.dtype]) for n in names}
        assert SubLayerWeights(sub, tensors, pin=False).nbytes == sizes[sub]


@settings(max_examples=25, deadline=None)
@given(cfg=model_configs())
def test_breakdown_parts(cfg):
    spec = ModelSpec.from_config(cfg)
    sizes = memory.sublayer_bytes(spec)
    names = [s.name for s in spec.sublayers]
    cpu = dict.fromkeys(names, Placement.CPU)
    assert memory.vram_breakdown(spec, cpu, 64, 4096, 2).total == 0
    pl = dict(cpu)
    pl["layers.0.attn"] = Placement.RESIDENT
    pl["layers.0.ffn"] = Placement.STREAMED
    pl["head"] = Placement.STREAMED
    v = memory.vram_breakdown(spec, pl, 16, 100, 2)
    assert v.weights == sizes["layers.0.attn"]
    assert v.slots == 2 * max(sizes["layers.0.ffn"], sizes["head"])
    assert v.kv == 112 * spec.sublayers[1].kv_bytes_per_token          # 100 tokens -> 7 blocks of 16
    assert v.scratch == memory.scratch_bytes(spec, 16)
    assert memory.vram_breakdown(spec, pl, 16, 100, 1).slots == max(sizes["layers.0.ffn"], sizes["head"])
    scratch = [memory.scratch_bytes(spec, t) for t in (1, 4, 16, 64, 256, 1024, 4096)]
    assert scratch == sorted(scratch) and scratch[0] > 0


def test_scratch_covers_a_moe_layer_run_in_one_call():
    """In steps of up to MOE_FEW_TOKENS tokens a MoE layer held in VRAM runs in one call: every expert of
    a group over the step's tokens (gate/up, product, output per expert) and each token's k kept rows.
    The scratch booked for such a tier holds those temporaries beside the matmul workspace, even where a
    small vocabulary leaves the head's logits no larger than attention's."""
    import dataclasses

    from engine.bench.shapes import get_shape
    from engine.config import MOE_FEW_TOKENS

    cfg = dataclasses.replace(get_shape("qwen3-30b-a3b"), num_layers=2, vocab_size=256)
    spec = ModelSpec.from_config(cfg)
    h, f, db = cfg.hidden_size, cfg.moe_intermediate_size, spec.dtype_bytes
    workspace = min(memory.WORKSPACE_MAX, spec.total_weight_bytes // 64)     # cuBLAS's, not activations
    for t in (1, 4, MOE_FEW_TOKENS):
        whole_group = t * cfg.experts_per_group * (4 * f + h) * db + t * cfg.num_experts_per_tok * h * db
        assert memory.scratch_bytes(spec, t) - workspace >= whole_group, t


def test_a_tiers_scratch_covers_every_smaller_step_of_a_moe_with_large_groups():
    """A MoE layer of steps up to MOE_FEW_TOKENS tokens runs in one call over a whole group's experts; with
    15-expert groups that had given the 16-token tier more scratch than the 64-token one (found by
    `test_breakdown_parts`' random configs)."""
    from engine.config import ModelConfig

    cfg = ModelConfig(arch="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                      rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=True, sliding_window=None, dtype="float32", bos_token_id=None,
                      eos_token_ids=(), num_experts=60, num_experts_per_tok=1, moe_intermediate_size=32,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=(), expert_group_size=15)
    spec = ModelSpec.from_config(cfg)
    scratch = [memory.scratch_bytes(spec, t) for t in (1, 4, 16, 64, 256, 1024, 4096)]
    assert scratch == sorted(scratch)
