"""Named model shapes: the `ModelConfig` of well-known models, for planning and benchmarks without files.

`python -m engine plan --model llama3-8b` and the benchmark harness use these; the planner only needs the
shape (sizes, dtype), never the weights. Values follow each model's published `config.json`.
"""

from __future__ import annotations

from engine.config import ModelConfig
from engine.errors import BadInputError

_LLAMA3_ROPE = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0),
                ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192))

SHAPES: dict[str, ModelConfig] = {
    "llama3-8b": ModelConfig(
        arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, max_position_embeddings=131072, tie_word_embeddings=False,
        dtype="bfloat16", bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "qwen3-8b": ModelConfig(
        arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True, dtype="bfloat16",
        eos_token_ids=(151645, 151643)),
    "qwen2.5-7b": ModelConfig(
        arch="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=True,
        dtype="bfloat16", eos_token_ids=(151645, 151643)),
    "smollm2-135m": ModelConfig(
        arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, dtype="bfloat16", bos_token_id=1,
        eos_token_ids=(2,)),
    "qwen3-30b-a3b": ModelConfig(
        arch="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=48,
        num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960, tie_word_embeddings=False, qk_norm=True, dtype="bfloat16",
        eos_token_ids=(151645, 151643), num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True),
}


def get_shape(name: str) -> ModelConfig:
    """The named shape; a clear error listing the known names otherwise."""
    try:
        return SHAPES[name.lower()]
    except KeyError:
        raise BadInputError(f"model shape {name!r}: unknown; known shapes are {', '.join(sorted(SHAPES))}") \
            from None
