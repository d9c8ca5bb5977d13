"""Shared helpers for the planner, estimator and profile tests: random model shapes, kind checks.

`model_configs()` draws dense shapes and, one time in four, mixture-of-experts ones (`moe_configs()`), so
every property of the planner, estimator and budget math is also checked on routers and expert groups.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.sharding.plan import Placement, Plan


def model_configs() -> st.SearchStrategy[ModelConfig]:
    """Dense configs (three in four) and MoE configs."""
    return st.one_of(dense_configs(), dense_configs(), dense_configs(), moe_configs())


@st.composite
def moe_configs(draw) -> ModelConfig:
    """Small MoE configs: qwen3_moe (some layers dense) or mixtral, 2 to 64 experts, top-1 to top-8, groups
    of the default size or other sizes (uneven last groups), at most 16 groups per layer."""
    base = draw(dense_configs())
    arch = draw(st.sampled_from(["qwen3_moe", "mixtral"]))
    experts = draw(st.sampled_from([2, 4, 8, 16, 60, 64]))
    group = draw(st.sampled_from([0, 1, 3, max(1, experts // 4), -(-experts // 16)]))
    if group and -(-experts // group) > 16:
        group = 0
    layers = base.num_layers
    dense_layers = () if arch == "mixtral" else tuple(draw(st.sets(st.integers(0, layers - 1), max_size=2)))
    return dataclasses.replace(
        base, arch=arch, num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(8, experts))),
        moe_intermediate_size=draw(st.sampled_from([16, 32, 96, 128])),
        norm_topk_prob=arch == "mixtral" or draw(st.booleans()),
        decoder_sparse_step=1 if arch == "mixtral" else draw(st.sampled_from([1, 1, 2])),
        mlp_only_layers=dense_layers, expert_group_size=group,
        attention_bias=False, qk_norm=arch == "qwen3_moe")


@st.composite
def dense_configs(draw) -> ModelConfig:
    """Small-ish dense configs: tied or untied, GQA or MHA, with or without q/k/v bias and q/k norm."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if heads % d == 0]))
    head_dim = draw(st.sampled_from([8, 16, 64, 128]))
    hidden = draw(st.sampled_from([64, 128, 256, 512, 1024, 2048]))
    return ModelConfig(
        arch=draw(st.sampled_from(["llama", "qwen2", "qwen3", "mistral"])),
        vocab_size=draw(st.sampled_from([256, 1000, 32000, 128256])),
        hidden_size=hidden,
        intermediate_size=draw(st.integers(1, 4)) * hidden + draw(st.sampled_from([0, 64])),
        num_layers=draw(st.integers(1, 6)),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=draw(st.booleans()),
        attention_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        dtype=draw(st.sampled_from(["float32", "bfloat16", "float16"])))


def is_kind(plan: Plan, kind: str) -> bool:
    """Does the placement satisfy the definition of `kind`? (The embedding gather does not count as CPU
    compute.)"""
    cpu = [n for n, p in plan.placement.items() if p is Placement.CPU and n != "embed"]
    streamed = [n for n, p in plan.placement.items() if p is Placement.STREAMED]
    if kind == "gpu_only":
        return not cpu
    if kind == "static":
        return not streamed
    return bool(streamed) and bool(cpu)


def kv_sides(plan: Plan) -> dict[str, bool]:
    """Per layer: whether its KV cache lives in VRAM under `plan` (a layer whose KV is there runs its
    attention on the GPU)."""
    out = {}
    for n, p in plan.placement.items():
        if n.endswith(".attn"):
            out[n] = plan.kv_on_gpu(int(n.split(".")[1]))
            assert p is not Placement.CPU or not out[n], (n, p)
    return out
