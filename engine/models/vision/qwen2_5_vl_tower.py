"""The Qwen2.5-VL vision tower as plain functions over a dict of weights.

pixel_values [n_patches, C*T*P*P] (from `qwen2_5_vl_processor`) -> image embeddings
[n_patches / merge^2, out_hidden], matching transformers' `Qwen2_5_VisionTransformerPretrainedModel`:

1. patch embedding: the Conv3d with kernel = stride = (T, P, P) is one matmul with its weight
   flattened to [hidden, C*T*P*P];
2. 2-D rotary embedding: each patch's (row, col) in its image; the first half of the rotary slots
   rotate by the row, the second by the column (head_dim/2 frequencies of base `rope_theta`);
3. the sequence is reordered window by window: groups of merge x merge patches (one future token)
   are laid out window_size/(patch*merge) tokens square at a time, so each window is contiguous;
4. `depth` pre-norm blocks (RMSNorm, attention, RMSNorm, SwiGLU MLP with biases); blocks listed in
   `fullatt_block_indexes` attend over the whole image, the others only within their window;
5. the merger: RMSNorm, then each merge x merge group concatenated -> Linear -> GELU -> Linear, and the
   window order undone.

Attention runs through `torch.nn.functional.scaled_dot_product_attention` one segment (window or
image) at a time, same-length windows batched, and queries tiled so no call's score matrix exceeds
`attn_mem_cap` bytes: a 1440p image never builds an N x N matrix.

Weights use the names of `vision_weight_names`: "vision.patch_embed.weight",
"vision.blocks.{i}.{attn_norm,qkv,o,ffn_norm,gate,up,down}.*", "vision.merger.{norm,fc1,fc2}.*".
`encode_images` moves one block's weights at a time to the device (the tower can stay in host memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.models.vision.qwen2_5_vl_processor import (
    ImageProcessorConfig,
    image_token_count,
    preprocess_images,
)

DEFAULT_ATTN_MEM_CAP = 256 * 1024 * 1024   # bytes of attention scores per SDPA call
VISION_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int                    # the language model's hidden size
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    in_channels: int = 3
    window_size: int = 112                  # pixels per window side
    fullatt_block_indexes: tuple[int, ...] = ()
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    image_token_id: int = -1
    video_token_id: int = -1
    vision_start_token_id: int = -1
    vision_end_token_id: int = -1
    mrope_section: tuple[int, ...] = ()     # the language model's M-RoPE split of head_dim/2
    tokens_per_second: int = 2
    dtype: str = "float32"
    processor: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size * self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


def vision_weight_names(vcfg: VisionConfig) -> dict[str, tuple[str, ...]]:
    """Canonical vision weight names grouped by the unit streamed to the device."""
    groups = {"vision.embed": ("vision.patch_embed.weight",)}
    for i in range(vcfg.depth):
        p = f"vision.blocks.{i}."
        groups[p.rstrip(".")] = tuple(p + n for n in (
            "attn_norm.weight", "qkv.weight", "qkv.bias", "o.weight", "o.bias", "ffn_norm.weight",
            "gate.weight", "gate.bias", "up.weight", "up.bias", "down.weight", "down.bias"))
    groups["vision.merger"] = tuple("vision.merger." + n for n in (
        "norm.weight", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"))
    return groups


def vision_weight_shapes(vcfg: VisionConfig) -> dict[str, tuple[int, ...]]:
    h, f, o, mh = vcfg.hidden_size, vcfg.intermediate_size, vcfg.out_hidden_size, vcfg.hidden_size * vcfg.merge_unit
    local = {"attn_norm.weight": (h,), "qkv.weight": (3 * h, h), "qkv.bias": (3 * h,), "o.weight": (h, h),
             "o.bias": (h,), "ffn_norm.weight": (h,), "gate.weight": (f, h), "gate.bias": (f,),
             "up.weight": (f, h), "up.bias": (f,), "down.weight": (h, f), "down.bias": (h,)}
    shapes = {"vision.patch_embed.weight": (h, vcfg.patch_dim), "vision.merger.norm.weight": (h,),
              "vision.merger.fc1.weight": (mh, mh), "vision.merger.fc1.bias": (mh,),
              "vision.merger.fc2.weight": (o, mh), "vision.merger.fc2.bias": (o,)}
    for i in range(vcfg.depth):
        for n, s in local.items():
            shapes[f"vision.blocks.{i}.{n}"] = s
    return shapes


# ---- index bookkeeping (from the grids alone) -----------------------------------------------------

def patch_positions(grids_thw, merge: int) -> torch.Tensor:
    """int64 [n_patches, 2]: (row, col) of every patch, in the processor's merge-block order."""
    out = []
    for t, h, w in grids_thw:
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        rc = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
        out.append(rc.repeat(t, 1))
    return torch.cat(out, dim=0)


def window_order(grids_thw, vcfg: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """(order, window lengths): `order` [n_units] lists the merged units (groups of merge^2 patches)
    window by window (windows in raster order, units in raster order inside each); the lengths are
    each window's size in patches, in that order."""
    side = vcfg.window_size // vcfg.spatial_merge_size // vcfg.patch_size
    order, lengths, offset = [], [], 0
    for t, h, w in grids_thw:
        gh, gw = h // vcfg.spatial_merge_size, w // vcfg.spatial_merge_size
        units = torch.arange(t * gh * gw).view(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    win = units[f, r:r + side, c:c + side].reshape(-1)
                    order.append(win + offset)
                    lengths.append(win.numel() * vcfg.merge_unit)
        offset += t * gh * gw
    return torch.cat(order), lengths


def image_lengths(grids_thw) -> list[int]:
    """Full-attention segments: one per image frame, h*w patches each."""
    return [h * w for t, h, w in grids_thw for _ in range(t)]


def vision_rotary(positions: torch.Tensor, vcfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n, 2] -> (cos, sin) float32 [n, head_dim]: rows rotate the first quarter of the
    frequency slots' pairs, columns the second (then duplicated for rotate-half)."""
    half = vcfg.head_dim // 2
    inv = 1.0 / (vcfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
    freqs = positions.float()[:, :, None] * inv[None, None, :]          # [n, 2, head_dim/4]
    freqs = freqs.reshape(positions.shape[0], -1)                        # rows then cols
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


# ---- the math ------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = VISION_NORM_EPS) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d]; cos/sin float32 [n, d]; computed in float32 and cast back (as the reference)."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                        mem_cap: int = DEFAULT_ATTN_MEM_CAP) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of `lengths` tokens.

    q, k, v: [heads, n, d] -> [heads, n, d]. Segments of equal length run as one batched SDPA call;
    batches and, for a long segment, query tiles are cut so that a call's scores
    (batch x heads x queries x keys x element size) stay within `mem_cap` bytes."""
    heads, n, d = q.shape
    out = torch.empty_like(q)
    elem = max(q.element_size(), 4)
    starts = [0]
    for n_len in lengths:
        starts.append(starts[-1] + n_len)
    if starts[-1] != n:
        raise ValueError(f"segment lengths sum to {starts[-1]}, the sequence has {n} tokens")
    by_len: dict[int, list[int]] = {}
    for s, n_len in zip(starts, lengths):
        if n_len:
            by_len.setdefault(n_len, []).append(s)
    for n_len, seg_starts in by_len.items():
        per_query = heads * n_len * elem                     # score bytes of one query row
        q_tile = max(1, min(n_len, mem_cap // per_query))
        batch = max(1, mem_cap // (per_query * q_tile)) if q_tile == n_len else 1
        offsets = torch.arange(n_len, device=q.device)
        for b0 in range(0, len(seg_starts), batch):
            s = torch.tensor(seg_starts[b0:b0 + batch], device=q.device)
            idx = (s[:, None] + offsets[None, :]).reshape(-1)             # [B*L]
            B = s.numel()
            kb = k[:, idx].view(heads, B, n_len, d).transpose(0, 1)     # [B, heads, L, d]
            vb = v[:, idx].view(heads, B, n_len, d).transpose(0, 1)
            qb = q[:, idx].view(heads, B, n_len, d).transpose(0, 1)
            if q_tile == n_len:
                ob = F.scaled_dot_product_attention(qb, kb, vb)
            else:
                ob = torch.cat([F.scaled_dot_product_attention(qb[:, :, a:a + q_tile], kb, vb)
                                for a in range(0, n_len, q_tile)], dim=2)
            out[:, idx] = ob.transpose(0, 1).reshape(heads, B * n_len, d)
    return out


def vision_block(vcfg: VisionConfig, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, lengths: list[int], mem_cap: int = DEFAULT_ATTN_MEM_CAP) -> torch.Tensor:
    """One block; `w` uses local names ("qkv.weight", ...); x [n, hidden] in window order."""
    n = x.shape[0]
    h = rms_norm(x, w["attn_norm.weight"])
    qkv = F.linear(h, w["qkv.weight"], w["qkv.bias"]).view(n, 3, vcfg.num_heads, vcfg.head_dim)
    q, k, v = qkv.unbind(1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    attn = segmented_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), lengths, mem_cap)
    x = x + F.linear(attn.transpose(0, 1).reshape(n, vcfg.hidden_size), w["o.weight"], w["o.bias"])
    h = rms_norm(x, w["ffn_norm.weight"])
    act = _ACTS[vcfg.hidden_act]
    h = act(F.linear(h, w["gate.weight"], w["gate.bias"])) * F.linear(h, w["up.weight"], w["up.bias"])
    return x + F.linear(h, w["down.weight"], w["down.bias"])


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
         "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}


def merge_patches(vcfg: VisionConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The merger; `w` uses local names ("norm.weight", "fc1.weight", ...): [n, hidden] ->
    [n / merge^2, out_hidden]."""
    h = rms_norm(x, w["norm.weight"]).reshape(-1, vcfg.hidden_size * vcfg.merge_unit)
    h = F.gelu(F.linear(h, w["fc1.weight"], w["fc1.bias"]))
    return F.linear(h, w["fc2.weight"], w["fc2.bias"])


def _local(weights: dict[str, torch.Tensor], prefix: str, device, dtype) -> dict[str, torch.Tensor]:
    return {n[len(prefix):]: t.to(device=device, dtype=dtype, non_blocking=True)
            for n, t in weights.items() if n.startswith(prefix)}


def encode_pixels(weights: dict[str, torch.Tensor], vcfg: VisionConfig, pixel_values: torch.Tensor,
                  grid_thw, *, device=None, dtype: torch.dtype | None = None,
                  attn_mem_cap: int = DEFAULT_ATTN_MEM_CAP) -> torch.Tensor:
    """pixel_values [n_patches, C*T*P*P] + grids -> embeddings [n_patches / merge^2, out_hidden] (all
    images concatenated, in image order) on `device`. Weights may live on the CPU: each block's are
    copied to `device` when it runs and dropped after."""
    grids = [tuple(int(v) for v in g) for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]
    embed_w = weights["vision.patch_embed.weight"]
    device = torch.device(device) if device is not None else embed_w.device
    dtype = dtype or embed_w.dtype
    unit = vcfg.merge_unit
    n = pixel_values.shape[0]
    if n != sum(t * h * w for t, h, w in grids):
        raise ValueError(f"pixel_values has {n} patches, the grids {grids} need {sum(t * h * w for t, h, w in grids)}")

    order, window_lengths = window_order(grids, vcfg)
    patch_order = (order[:, None] * unit + torch.arange(unit)[None, :]).reshape(-1).to(device)
    full_lengths = image_lengths(grids)
    cos, sin = vision_rotary(patch_positions(grids, vcfg.spatial_merge_size), vcfg)
    cos, sin = cos.to(device)[patch_order], sin.to(device)[patch_order]

    pe = embed_w.to(device=device, dtype=dtype).reshape(vcfg.hidden_size, -1)
    x = F.linear(pixel_values.to(device=device, dtype=dtype), pe)[patch_order]
    del pe
    full = set(vcfg.fullatt_block_indexes)
    for i in range(vcfg.depth):
        w = _local(weights, f"vision.blocks.{i}.", device, dtype)
        x = vision_block(vcfg, w, x, cos, sin, full_lengths if i in full else window_lengths, attn_mem_cap)
        del w
    merged = merge_patches(vcfg, _local(weights, "vision.merger.", device, dtype), x)
    return merged[torch.argsort(order.to(device))]


def encode_images(weights: dict[str, torch.Tensor], vcfg: VisionConfig, images, device=None, *,
                  dtype: torch.dtype | None = None, attn_mem_cap: int = DEFAULT_ATTN_MEM_CAP,
                  pcfg: ImageProcessorConfig | None = None) -> list[torch.Tensor]:
    """Images (paths, bytes, PIL images) -> one embedding tensor [n_tokens_i, out_hidden] per image,
    n_tokens_i = `image_token_count(grid_i)` (the count of image pad tokens the prompt needs)."""
    from engine.models.vision.image_input import load_image

    pcfg = pcfg or vcfg.processor
    pil = [load_image(im, index=i) for i, im in enumerate(images)]
    pixel_values, grids = preprocess_images(pil, pcfg)
    emb = encode_pixels(weights, vcfg, pixel_values, grids, device=device, dtype=dtype, attn_mem_cap=attn_mem_cap)
    counts = [image_token_count(g, vcfg.spatial_merge_size) for g in grids.tolist()]
    return list(emb.split(counts, dim=0))


def attention_scores_bytes(n_tokens: int, vcfg: VisionConfig, mem_cap: int = DEFAULT_ATTN_MEM_CAP,
                           elem: int = 4) -> int:
    """The largest score buffer one SDPA call of a full-attention block builds for an image of
    `n_tokens` patches (for planning VRAM): min(cap, heads * n^2 * elem) rounded to whole query rows."""
    per_query = vcfg.num_heads * n_tokens * elem
    return min(n_tokens, max(1, mem_cap // per_query)) * per_query if n_tokens else 0


__all__ = ["DEFAULT_ATTN_MEM_CAP", "VisionConfig", "attention_scores_bytes", "encode_images", "encode_pixels",
           "merge_patches", "segmented_attention", "vision_block", "vision_weight_names",
           "vision_weight_shapes"]
