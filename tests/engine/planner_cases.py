"""Shared helpers for the planner, estimator and profile tests: random model shapes, kind checks."""

from __future__ import annotations

from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.sharding.plan import Placement, Plan


@st.composite
def model_configs(draw) -> ModelConfig:
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


def attention_sides(plan: Plan) -> dict[str, bool]:
    return {n: p is not Placement.CPU for n, p in plan.placement.items() if n.endswith(".attn")}
