"""The model configuration every loader produces and every model reads.

One frozen dataclass, independent of the file format: Hugging Face `config.json` and GGUF metadata are
both translated into it by `engine.loading`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the torch engine runs (values of `ModelConfig.arch`).
DENSE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral")
SUPPORTED_ARCHS = DENSE_ARCHS + MOE_ARCHS
EXPERT_GROUPS = 8                  # expert groups per MoE layer by default (see `experts_per_group`)


# A MoE layer whose experts are all in one place runs whole, in one call, for steps of up to this many
# tokens (`engine.models.moe.layer_few_tokens`); the planner's memory and time models follow it.
MOE_FEW_TOKENS = 16

@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str                      # one of SUPPORTED_ARCHS
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
    # Mixture of experts (num_experts 0 = a dense model). A MoE layer's FFN is a router over
    # `num_experts` SwiGLU experts of width `moe_intermediate_size`, of which each token uses the top
    # `num_experts_per_tok`; layers listed in `mlp_only_layers` or off the `decoder_sparse_step` grid
    # are dense FFNs of width `intermediate_size` (qwen3_moe). `norm_topk_prob`: renormalise the top-k
    # routing weights to sum to 1 (always so for mixtral).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Experts per expert-group sub-layer (the unit the planner places and the executor streams);
    # 0 = ceil(num_experts / EXPERT_GROUPS).
    expert_group_size: int = 0

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Does `layer` route over experts (else it has a dense FFN)?"""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def experts_per_group(self) -> int:
        """G: experts per expert-group sub-layer (the last group of a layer may hold fewer)."""
        if self.expert_group_size > 0:
            return min(self.expert_group_size, self.num_experts)
        return max(1, -(-self.num_experts // EXPERT_GROUPS))

    def expert_groups(self) -> list[range]:
        """The experts of each group of a MoE layer, in order."""
        g = self.experts_per_group
        return [range(a, min(a + g, self.num_experts)) for a in range(0, self.num_experts, g)]


def weight_names(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Canonical weight names grouped by sub-layer: {"embed": (...), "layers.0.attn": (...), ...}.

    Loaders produce exactly these names (plus nothing else); the executor places them by sub-layer.
    MoE layers have `layers.{i}.ffn` (norm and router) and `layers.{i}.experts.{g}` (expert groups).
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
        if not cfg.is_moe_layer(i):
            groups[p + "ffn"] = (p + "ffn_norm.weight", p + "gate.weight", p + "up.weight", p + "down.weight")
            continue
        # A MoE layer: the norm and router stay together; the experts form groups, each one sub-layer
        # packed expert by expert (gate, up, down), so a group streams as one copy.
        groups[p + "ffn"] = (p + "ffn_norm.weight", p + "router.weight")
        for g, experts in enumerate(cfg.expert_groups()):
            groups[f"{p}experts.{g}"] = tuple(f"{p}experts.{e}.{m}.weight" for e in experts
                                              for m in ("gate", "up", "down"))
    # A tied output head reads the embedding matrix: the head sub-layer then owns its own copy of it
    # wherever it is placed (the embedding lookup itself only gathers rows).
    groups["head"] = ("norm.weight", "embed.weight" if cfg.tie_word_embeddings else "head.weight")
    return groups


def _local_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, f, q, kv, e = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.moe_intermediate_size
    return {"attn_norm.weight": (h,), "ffn_norm.weight": (h,), "q.weight": (q, h), "k.weight": (kv, h),
            "v.weight": (kv, h), "o.weight": (h, q), "q.bias": (q,), "k.bias": (kv,), "v.bias": (kv,),
            "q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,),
            "gate.weight": (f, h), "up.weight": (f, h), "down.weight": (h, f),
            "router.weight": (cfg.num_experts, h),
            "expert.gate.weight": (e, h), "expert.up.weight": (e, h), "expert.down.weight": (h, e),
            "embed.weight": (cfg.vocab_size, h), "head.weight": (cfg.vocab_size, h), "norm.weight": (h,)}


def _local_name(name: str) -> str:
    """'layers.3.q.weight' -> 'q.weight'; 'layers.3.experts.17.up.weight' -> 'expert.up.weight'."""
    if not name.startswith("layers."):
        return name
    local = name.split(".", 2)[2]
    return "expert." + local.split(".", 2)[2] if local.startswith("experts.") else local


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every canonical weight (the names of `weight_names(cfg)`) under `cfg`."""
    local = _local_shapes(cfg)
    return {n: local[_local_name(n)] for names in weight_names(cfg).values() for n in names}


def weight_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape of the canonical weight `name` under `cfg`."""
    return _local_shapes(cfg)[_local_name(name)]
