"""Budget math: how many bytes of VRAM a placement needs, computed exactly as the executor books them.

A plan's VRAM is resident weights + streaming slots + the KV cache of the layers whose attention runs on
the GPU + scratch (activations and workspace for a step of the tier's size, with a margin). Weight bytes
are the executor's packed sizes (each tensor rounded up to `TENSOR_ALIGN`), KV is booked in blocks of
`KV_BLOCK` tokens, and slots are min(n_slots, number streamed) x the largest streamed sub-layer. A plan
with nothing on the GPU needs 0 bytes: budget 0 is always valid.
"""

from __future__ import annotations

import math
from functools import lru_cache

from engine.config import MOE_FEW_TOKENS, ModelConfig, weight_shapes
from engine.sharding.plan import Placement, VramBreakdown
from engine.sharding.spec import ModelSpec

TENSOR_ALIGN = 256          # must equal engine.sharding.weights._ALIGN (packed host/VRAM buffers)
KV_BLOCK = 16               # must equal engine.sharding.kvcache.BLOCK_SIZE
HEAD_ROWS_MAX = 256         # logits are computed for at most this many rows at a time
HEAD_ROWS_MIN = 32          # ... and on the GPU for at least this many (a batch's decode rows in one pass)
SCRATCH_MARGIN = 1.5        # activations x margin (allocator rounding, fragmentation, temporaries)
WORKSPACE_MAX = 32 << 20    # BLAS / attention workspace of a real model (scaled down for tiny ones)


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every canonical weight (the names of `engine.config.weight_names`)."""
    return weight_shapes(cfg)


@lru_cache(maxsize=64)
def sublayer_bytes(spec: ModelSpec) -> dict[str, int]:
    """Bytes of each sub-layer's packed weight buffer (what a resident copy or a slot must hold)."""
    shapes = tensor_shapes(spec.config)
    out = {}
    for sub in spec.sublayers:
        total = 0
        for n in sub.weight_names:
            nbytes = math.prod(shapes[n]) * (4 if n in spec.wide else spec.dtype_bytes)
            total += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
        out[sub.name] = total
    return out


def kv_cache_bytes(spec: ModelSpec, kv_tokens: int, n_layers: int | None = None) -> int:
    """KV cache bytes for `kv_tokens` tokens (rounded up to whole blocks) of `n_layers` layers (all)."""
    n = spec.config.num_layers if n_layers is None else n_layers
    per_token = next((s.kv_bytes_per_token for s in spec.sublayers if s.kind == "attn"), 0)
    return n * -(-max(kv_tokens, 0) // KV_BLOCK) * KV_BLOCK * per_token


def _layer_temporaries(cfg, db: int, t: int) -> tuple[int, int]:
    """(residual stream with its float32 norm, the largest of attention's, the FFN's and the MoE block's
    temporaries) of a step of t tokens, in bytes."""
    h = cfg.hidden_size
    resid = t * h * db + 2 * t * h * 4
    attn = t * db * (4 * cfg.q_size + 2 * cfg.kv_size)
    ffn = 3 * t * cfg.intermediate_size * db
    if cfg.is_moe:
        k, f = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        moe = t * (2 * h * db + 3 * cfg.num_experts * 4 + 4 * k * 8 + (3 * h + 4 * f) * db)
        # a layer in one call (steps of up to MOE_FEW_TOKENS) runs all of a group's experts over the step's
        # tokens; a larger tier covers it too, so a tier's scratch holds any smaller step's (a 64-token
        # tier of a config with 15-expert groups had booked less than its 16-token tier)
        few = min(t, MOE_FEW_TOKENS)
        moe = max(moe, few * (2 * h * db + cfg.experts_per_group * (4 * f + h) * db + 2 * k * h * db))
        ffn = max(ffn, moe)
    return resid, max(attn, ffn)


def head_rows_at_once(cfg, db: int, tier: int) -> int:
    """Rows of logits the head computes at once on the GPU in a step of `tier` tokens (a prompt scored
    whole, a batch's decode): at most HEAD_ROWS_MAX, and no more than the layers' own temporaries of the
    step hold, but at least HEAD_ROWS_MIN. A large vocabulary's float32 logits had dominated the scratch
    of long steps: 256 rows of Qwen2.5's 152k took 241 MB against 29 MB of FFN temporaries at 256
    tokens, which left a 2 GiB budget no room for the slots that stream its FFNs."""
    t = max(int(tier), 1)
    per_row = 2 * cfg.hidden_size * 4 + cfg.vocab_size * (db + 4)
    return min(t, HEAD_ROWS_MAX, max(HEAD_ROWS_MIN, _layer_temporaries(cfg, db, t)[1] // per_row))


def scratch_bytes(spec: ModelSpec, tier: int) -> int:
    """Activations and workspace on the GPU for a step of `tier` new tokens, margin included.

    Peak of one sub-layer's temporaries: the residual stream and its float32 norm, plus the largest of
    attention (q, k, v, rotary copies, output), the FFN (gate, up, product), the MoE block and the head
    (float32 logits of `head_rows_at_once` rows). Attention itself is assumed to run in a fused kernel
    (no [n, ctx] scores). The MoE block holds the normed input and the output sum across its groups, the
    float32 router probabilities, the routing (top-k ids and weights, sorted) and one expert's
    temporaries for at most all t rows (gathered input, gate/up, product, output); in steps of up to
    moe.FEW_TOKENS tokens, or a whole group's (`moe.layer_few_tokens`: every expert of a group over the
    tokens, and each token's k kept rows).
    """
    cfg, db = spec.config, spec.dtype_bytes
    t, h = max(int(tier), 1), cfg.hidden_size
    resid, layer = _layer_temporaries(cfg, db, t)
    head = head_rows_at_once(cfg, db, t) * (2 * h * 4 + cfg.vocab_size * (db + 4))
    workspace = min(WORKSPACE_MAX, spec.total_weight_bytes // 64)
    return math.ceil((resid + max(layer, head)) * SCRATCH_MARGIN) + workspace


def transfer_bytes(spec: ModelSpec) -> dict[str, int]:
    """Bytes a whole streamed copy of each sub-layer moves over PCIe: its transfer-coded size where it
    has one, else its packed size."""
    sizes = dict(sublayer_bytes(spec))
    sizes.update(spec.transfer)
    return sizes


def stage_ring_bytes(spec: ModelSpec) -> int:
    """VRAM of transfer coding's staging ring, booked with the slots whenever anything streams, and of the
    index a copy's escapes are put with (`transfer_code.apply_escapes`)."""
    from engine.sharding.transfer_code import N_STAGES

    return N_STAGES * spec.stage_bytes + spec.escape_index_bytes if spec.transfer else 0


def slot_bytes(spec: ModelSpec, placement: dict[str, Placement], n_slots: int) -> int:
    """VRAM of the streaming slots: min(n_slots, number streamed) x the largest streamed sub-layer (plus the
    staging ring of coded copies)."""
    sizes = sublayer_bytes(spec)
    streamed = [sizes[n] for n, p in placement.items() if p is Placement.STREAMED]
    n = min(n_slots, len(streamed))
    return n * max(streamed, default=0) + (stage_ring_bytes(spec) if n else 0)


def gpu_attention_layers(spec: ModelSpec, placement: dict[str, Placement]) -> int:
    """How many layers run attention on the GPU (their KV cache lives there)."""
    return sum(1 for s in spec.sublayers if s.kind == "attn" and placement[s.name] is not Placement.CPU)


def any_host_kv_attention(spec: ModelSpec, placement: dict[str, Placement], kv_layers: int | None) -> bool:
    """Whether a layer runs attention on the GPU over a KV cache kept in host memory (layers from
    `kv_layers` on; None: never, each layer's KV lives where its attention runs)."""
    return kv_layers is not None and any(s.kind == "attn" and s.layer >= kv_layers
                                         and placement[s.name] is not Placement.CPU for s in spec.sublayers)


def vram_breakdown(spec: ModelSpec, placement: dict[str, Placement], tier: int, kv_tokens: int,
                   n_slots: int, kv_layers: int | None = None) -> VramBreakdown:
    """The VRAM a placement needs for steps of `tier` tokens with a KV capacity of `kv_tokens`. With
    `kv_layers`, only the first kv_layers layers hold their KV in VRAM; a GPU attention past them copies
    its layer's KV into scratch for the step (one layer's worth)."""
    sizes = sublayer_bytes(spec)
    on_gpu = any(p is not Placement.CPU for p in placement.values())
    n_kv = gpu_attention_layers(spec, placement) if kv_layers is None else kv_layers
    host_kv = any_host_kv_attention(spec, placement, kv_layers)
    return VramBreakdown(
        weights=sum(sizes[n] for n, p in placement.items() if p is Placement.RESIDENT),
        kv=kv_cache_bytes(spec, kv_tokens, n_kv),
        slots=slot_bytes(spec, placement, n_slots),
        scratch=(scratch_bytes(spec, tier) + host_kv * kv_cache_bytes(spec, kv_tokens, 1)) if on_gpu else 0)
