"""The shape of a model as the planner sees it: sub-layers with their bytes and work per token.

`ModelSpec.from_config` turns a `ModelConfig` into an ordered list of `SubLayerSpec` (embed, then
attn/ffn per layer, then head). The planner prices these; the executor places the weights named here.

A mixture-of-experts layer has three kinds of sub-layer: its attention, its `ffn` (kind "router": the
norm and the router matmul) and its expert groups (kind "experts", `layers.{i}.experts.{g}`). An expert
group's `flops_per_token` is the expected work of one token under uniform routing (k of E experts each,
so k * n_experts / E of this group's experts per token); `expected_experts` says how many distinct
experts of the group a step of t tokens touches, which is what the CPU or GPU reads of its weights.

A streamed expert group is copied whole, ahead of its router (prefetch), or, in steps where few of its
experts are expected to be touched (`routed_streaming`), only the experts the router picked, once the
router has run: the executor and the estimator apply the same rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ModelConfig, weight_names, weight_shapes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# A streamed expert group copies only its routed experts in steps expected to touch less than this
# fraction of its experts (below it the bytes saved outweigh losing the copy's start before the router).
ROUTED_STREAM_MAX = 0.5


def touched_fraction(cfg: ModelConfig, n_tokens: float) -> float:
    """Expected fraction of a MoE layer's experts that a step of `n_tokens` tokens routes to, under
    uniform routing (each token picks k of the E experts at random): 1 - (1 - k/E)^t."""
    if not cfg.num_experts:
        return 0.0
    miss = 1.0 - cfg.num_experts_per_tok / cfg.num_experts
    return 1.0 - miss ** max(n_tokens, 0)


def routed_streaming(cfg: ModelConfig, n_tokens: float) -> bool:
    """Do streamed expert groups copy only their routed experts in a step of `n_tokens` tokens?"""
    return cfg.is_moe and touched_fraction(cfg, n_tokens) < ROUTED_STREAM_MAX


@dataclass(frozen=True, slots=True)
class SubLayerSpec:
    name: str                  # "embed" | "layers.{i}.attn" | "layers.{i}.ffn" | "layers.{i}.experts.{g}"
                               # | "head"
    kind: str                  # "embed" | "attn" | "ffn" | "router" | "experts" | "head"
    layer: int | None
    weight_names: tuple[str, ...]
    weight_bytes: int          # bytes of all its weights at the run precision
    flops_per_token: int       # matmul FLOPs per new token (2 x MACs), excluding attention over the context
    kv_bytes_per_token: int    # KV cache bytes per cached token (attn only)
    attn_flops_per_token_ctx: int  # attention FLOPs per new token per context token (attn only)
    n_experts: int = 0         # experts in this group (experts only)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    config: ModelConfig
    dtype_bytes: int
    kv_dtype_bytes: int
    sublayers: tuple[SubLayerSpec, ...]
    wide: frozenset[str] = frozenset()   # weights stored in float32 beside 16-bit ones (GGUF norms, routers)
    # Transfer coding (engine.sharding.transfer_code): the bytes a whole streamed copy of each coded
    # sub-layer moves, one staging buffer's bytes (the ring of them is booked with the slots), and the int64
    # index a copy puts its escapes with (`transfer_code.apply_escapes`; booked with the ring)
    transfer: tuple[tuple[str, int], ...] = ()
    stage_bytes: int = 0
    escape_index_bytes: int = 0

    def with_transfer(self, sizes: dict[str, int], stage_bytes: int, escape_index_bytes: int = 0) -> ModelSpec:
        """This spec with the coded sub-layers' transfer sizes (empty: no coding)."""
        from dataclasses import replace

        return replace(self, transfer=tuple(sorted(sizes.items())), stage_bytes=int(stage_bytes) if sizes else 0,
                       escape_index_bytes=int(escape_index_bytes) if sizes else 0)

    def widened(self, names) -> ModelSpec:
        """This spec with `names` held in float32 (4 bytes an element) while the rest run in the compute
        dtype, each sub-layer's bytes grown to match (the executor packs and books them at that size)."""
        wide = frozenset(names) - self.wide
        if not wide or self.dtype_bytes >= 4:
            return self
        from dataclasses import replace

        shapes, extra = weight_shapes(self.config), 4 - self.dtype_bytes
        subs = tuple(replace(s, weight_bytes=s.weight_bytes + extra * sum(
            math.prod(shapes[n]) for n in s.weight_names if n in wide)) for s in self.sublayers)
        return replace(self, sublayers=subs, wide=self.wide | wide)

    @staticmethod
    def from_config(cfg: ModelConfig, *, dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
        db = DTYPE_BYTES[dtype or cfg.dtype]
        fp8_kv = kv_dtype == "fp8"            # float8 e4m3 keys/values with a float32 scale per head
        kvb = 1 if fp8_kv else DTYPE_BYTES[kv_dtype or dtype or cfg.dtype]
        kv_per_token = 2 * cfg.num_kv_heads * (cfg.head_dim + 4) if fp8_kv else 2 * cfg.kv_size * kvb
        h, hd = cfg.hidden_size, cfg.head_dim
        groups = weight_names(cfg)
        subs: list[SubLayerSpec] = []
        for name, names in groups.items():
            if name == "embed":
                subs.append(SubLayerSpec(name, "embed", None, names, cfg.vocab_size * h * db, 0, 0, 0))
            elif name == "head":
                nbytes = (h + cfg.vocab_size * h) * db
                subs.append(SubLayerSpec(name, "head", None, names, nbytes, 2 * cfg.vocab_size * h, 0, 0))
            elif name.endswith(".attn"):
                layer = int(name.split(".")[1])
                proj = h * cfg.q_size * 2 + h * cfg.kv_size * 2  # q, o and k, v
                extra = h + (3 * 0)
                if cfg.attention_bias:
                    extra += cfg.q_size + 2 * cfg.kv_size
                if cfg.qk_norm:
                    extra += 2 * hd
                subs.append(SubLayerSpec(
                    name, "attn", layer, names, (proj + extra) * db, 2 * proj,
                    kv_per_token, 4 * cfg.num_heads * hd))
            elif ".experts." in name:
                layer, n_exp = int(name.split(".")[1]), len(names) // 3
                mats = 3 * h * cfg.moe_intermediate_size      # one expert
                used = cfg.num_experts_per_tok * n_exp / cfg.num_experts   # of its experts per token
                subs.append(SubLayerSpec(name, "experts", layer, names, n_exp * mats * db,
                                         round(2 * mats * used), 0, 0, n_exp))
            elif cfg.is_moe_layer(int(name.split(".")[1])):
                layer = int(name.split(".")[1])
                subs.append(SubLayerSpec(name, "router", layer, names, (cfg.num_experts * h + h) * db,
                                         2 * cfg.num_experts * h, 0, 0))
            else:
                layer = int(name.split(".")[1])
                mats = 3 * h * cfg.intermediate_size
                subs.append(SubLayerSpec(name, "ffn", layer, names, (mats + h) * db, 2 * mats, 0, 0))
        return ModelSpec(cfg, db, kvb, tuple(subs))

    def expected_experts(self, sub: SubLayerSpec, n_tokens: float) -> float:
        """Distinct experts of group `sub` that a step of `n_tokens` tokens touches, in expectation,
        assuming uniform routing (each token picks k of the E experts at random): an expert is missed
        by one token with probability 1 - k/E, so the group of n touches n * (1 - (1 - k/E)^t)."""
        return sub.n_experts * touched_fraction(self.config, n_tokens)

    def expert_bytes(self, sub: SubLayerSpec) -> int:
        """Bytes of one expert of group `sub` (its three matrices)."""
        return sub.weight_bytes // max(sub.n_experts, 1)

    @property
    def total_weight_bytes(self) -> int:
        """Bytes of the model as it runs (a tied head counted once)."""
        n = sum(s.weight_bytes for s in self.sublayers)
        if self.config.tie_word_embeddings:
            n -= self.config.vocab_size * self.config.hidden_size * self.dtype_bytes
        return n

    def by_name(self) -> dict[str, SubLayerSpec]:
        return {s.name: s for s in self.sublayers}
