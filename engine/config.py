"""The model configuration every loader produces and every model reads.

One frozen dataclass, independent of the file format: Hugging Face `config.json` and GGUF metadata are
both translated into it by `engine.loading`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the torch engine runs (values of `ModelConfig.arch`).
DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str                      # one of DENSE_ARCHS (later also MoE and vision-language ones)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Hugging Face style rope scaling dict, e.g. {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192};
    # None for plain RoPE. Stored as a tuple of items so the dataclass stays hashable.
    rope_scaling: tuple[tuple[str, object], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False   # q/k/v projections carry a bias (qwen2)
    qk_norm: bool = False          # per-head RMSNorm on q and k before RoPE (qwen3)
    sliding_window: int | None = None
    dtype: str = "float32"         # the precision the weights are given in: float32 | bfloat16 | float16
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def weight_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical weight names grouped by sub-layer: {"embed": (...), "layers.0.attn": (...), ...}.

    Loaders produce exactly these names (plus nothing else); the executor places them by sub-layer.
    """
    groups: dict[str, tuple[str, ...]] = {"embed": ("embed.weight",)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        attn = [p + "attn_norm.weight", p + "q.weight", p + "k.weight", p + "v.weight", p + "o.weight"]
        if cfg.attention_bias:
            attn += [p + "q.bias", p + "k.bias", p + "v.bias"]
        if cfg.qk_norm:
            attn += [p + "q_norm.weight", p + "k_norm.weight"]
        groups[p + "attn"] = tuple(attn)
        groups[p + "ffn"] = (p + "ffn_norm.weight", p + "gate.weight", p + "up.weight", p + "down.weight")
    # A tied output head reads the embedding matrix: the head sub-layer then owns its own copy of it
    # wherever it is placed (the embedding lookup itself only gathers rows).
    groups["head"] = ("norm.weight", "embed.weight" if cfg.tie_word_embeddings else "head.weight")
    return groups
