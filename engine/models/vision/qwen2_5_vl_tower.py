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

    q, k, v: [heads, n, d] -> [heads, n, d]. Segments of equal length run as one batched SDPA call
    (their q, k, v gathered) where the batch's scores and gathered copies fit `mem_cap` bytes; a
    segment that does not fit runs alone, on views of q, k, v, its queries tiled so that a call's
    scores (heads x queries x keys x element size) and output stay within `mem_cap` where one query
    row allows it. A 1440p image's full attention never builds its N x N score matrix."""
    heads, n, d = q.shape
    out = torch.empty_like(q)
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
        q_tile, batch = attention_tiling(n_len, heads, d, q.element_size(), mem_cap)
        if batch == 1:                 # one segment at a time, on views; queries tiled
            for s in seg_starts:
                ks, vs = k[None, :, s:s + n_len], v[None, :, s:s + n_len]
                for a in range(s, s + n_len, q_tile):
                    b = min(s + n_len, a + q_tile)
                    out[:, a:b] = F.scaled_dot_product_attention(q[None, :, a:b], ks, vs)[0]
            continue
        offsets = torch.arange(n_len, device=q.device)
        for b0 in range(0, len(seg_starts), batch):
            s = torch.tensor(seg_starts[b0:b0 + batch], device=q.device)
            idx = (s[:, None] + offsets[None, :]).reshape(-1)             # [B*L]
            B = s.numel()
            kb = k[:, idx].view(heads, B, n_len, d).transpose(0, 1)     # [B, heads, L, d]
            vb = v[:, idx].view(heads, B, n_len, d).transpose(0, 1)
            qb = q[:, idx].view(heads, B, n_len, d).transpose(0, 1)
            ob = F.scaled_dot_product_attention(qb, kb, vb)
            out[:, idx] = ob.transpose(0, 1).reshape(heads, B * n_len, d)
    return out


def attention_tiling(n_len: int, heads: int, d: int, elem_size: int, mem_cap: int) -> tuple[int, int]:
    """(query tile, segments per call) for segments of `n_len` tokens (see `segmented_attention`):
    batches of whole segments when at least two fit the cap with their gathered q, k, v and output,
    else one segment per call with the queries tiled."""
    per_query = heads * n_len * max(elem_size, 4)            # score bytes of one query row
    gathered = 4 * heads * n_len * d * elem_size             # q, k, v and output of one gathered segment
    batch = mem_cap // (per_query * n_len + gathered)
    if batch >= 2:
        return n_len, int(batch)
    q_tile = max(1, min(n_len, mem_cap // (per_query + heads * d * elem_size)))
    return int(q_tile), 1


def attention_work_bytes(lengths, heads: int, d: int, elem_size: int, mem_cap: int) -> int:
    """The largest working memory (scores, gathered q, k, v and output) one SDPA call of
    `segmented_attention` takes for these segments (for booking VRAM). Fused kernels (flash, memory-
    efficient, the CPU's) build no scores; the bound covers an unfused one (scores and their softmax)."""
    peak = 0
    for n_len, count in _count_lengths(lengths).items():
        q_tile, batch = attention_tiling(n_len, heads, d, elem_size, mem_cap)
        score = 2 * heads * q_tile * n_len * max(elem_size, 4)     # an unfused kernel's scores and softmax
        if batch == 1:
            peak = max(peak, score + heads * q_tile * d * elem_size)
        else:
            b = min(batch, count)
            peak = max(peak, b * (score + 4 * heads * n_len * d * elem_size))
    return peak


def attention_calls(lengths, heads: int, d: int, elem_size: int, mem_cap: int) -> tuple[int, float]:
    """(SDPA calls, key/value bytes read) of `segmented_attention` over these segments (for timing)."""
    calls, kv_bytes = 0, 0.0
    for n_len, count in _count_lengths(lengths).items():
        q_tile, batch = attention_tiling(n_len, heads, d, elem_size, mem_cap)
        tiles = -(-n_len // q_tile)
        calls += -(-count // batch) * tiles if batch > 1 else count * tiles
        kv_bytes += count * tiles * 2 * heads * n_len * d * elem_size
    return calls, kv_bytes


def _count_lengths(lengths) -> dict[int, int]:
    out: dict[int, int] = {}
    for n_len in lengths:
        if n_len:
            out[n_len] = out.get(n_len, 0) + 1
    return out


def vision_block(vcfg: VisionConfig, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, lengths: list[int], mem_cap: int = DEFAULT_ATTN_MEM_CAP,
                 rows: int | None = None) -> torch.Tensor:
    """One block; `w` uses local names ("qkv.weight", ...); x [n, hidden] in window order.

    `rows`: the row-wise parts (norms, projections, rotary, MLP) run `rows` tokens at a time, so their
    temporaries stay within a memory cap for a large image; None = all rows at once. Only q, k, v and
    the attention output are whole-sequence tensors besides x, which is updated in place when chunked."""
    n = x.shape[0]
    rows = n if rows is None else max(1, min(int(rows), n))
    heads, d = vcfg.num_heads, vcfg.head_dim
    act = _ACTS[vcfg.hidden_act]
    q = torch.empty(heads, n, d, dtype=x.dtype, device=x.device)
    k, v = torch.empty_like(q), torch.empty_like(q)
    for a in range(0, n, rows):
        b = min(n, a + rows)
        h = rms_norm(x[a:b], w["attn_norm.weight"])
        qkv = F.linear(h, w["qkv.weight"], w["qkv.bias"]).view(b - a, 3, heads, d)
        del h
        qa, ka, va = qkv.unbind(1)
        q[:, a:b] = _rotate(qa, cos[a:b], sin[a:b]).transpose(0, 1)
        k[:, a:b] = _rotate(ka, cos[a:b], sin[a:b]).transpose(0, 1)
        v[:, a:b] = va.transpose(0, 1)
        del qkv, qa, ka, va
    attn = segmented_attention(q, k, v, lengths, mem_cap)
    del q, k, v
    if rows == n:
        x = x + F.linear(attn.transpose(0, 1).reshape(n, vcfg.hidden_size), w["o.weight"], w["o.bias"])
        del attn
        h = rms_norm(x, w["ffn_norm.weight"])
        h = act(F.linear(h, w["gate.weight"], w["gate.bias"])) * F.linear(h, w["up.weight"], w["up.bias"])
        return x + F.linear(h, w["down.weight"], w["down.bias"])
    for a in range(0, n, rows):
        b = min(n, a + rows)
        x[a:b] += F.linear(attn[:, a:b].transpose(0, 1).reshape(b - a, vcfg.hidden_size), w["o.weight"], w["o.bias"])
    del attn
    for a in range(0, n, rows):
        b = min(n, a + rows)
        h = rms_norm(x[a:b], w["ffn_norm.weight"])
        h = act(F.linear(h, w["gate.weight"], w["gate.bias"])) * F.linear(h, w["up.weight"], w["up.bias"])
        x[a:b] += F.linear(h, w["down.weight"], w["down.bias"])
    return x


_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"),
         "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}


def merge_patches(vcfg: VisionConfig, w: dict[str, torch.Tensor], x: torch.Tensor,
                  rows: int | None = None) -> torch.Tensor:
    """The merger; `w` uses local names ("norm.weight", "fc1.weight", ...): [n, hidden] ->
    [n / merge^2, out_hidden]; `rows` (rounded up to whole merge groups) runs it a chunk at a time."""
    n, unit = x.shape[0], vcfg.merge_unit

    def merge(part: torch.Tensor) -> torch.Tensor:
        h = rms_norm(part, w["norm.weight"]).reshape(-1, vcfg.hidden_size * unit)
        h = F.gelu(F.linear(h, w["fc1.weight"], w["fc1.bias"]))
        return F.linear(h, w["fc2.weight"], w["fc2.bias"])

    if rows is None or rows >= n:
        return merge(x)
    step = -(-int(rows) // unit) * unit
    out = torch.empty(n // unit, vcfg.out_hidden_size, dtype=x.dtype, device=x.device)
    for a in range(0, n, step):
        out[a // unit:(a + step) // unit] = merge(x[a:a + step])
    return out


def _local(weights: dict[str, torch.Tensor], prefix: str, device, dtype) -> dict[str, torch.Tensor]:
    return {n[len(prefix):]: t.to(device=device, dtype=dtype, non_blocking=True)
            for n, t in weights.items() if n.startswith(prefix)}


def vision_groups(vcfg: VisionConfig) -> list[str]:
    """The tower's weight groups in the order they run (the units streamed to the device)."""
    return ["vision.embed", *(f"vision.blocks.{i}" for i in range(vcfg.depth)), "vision.merger"]


def _grid_list(grid_thw) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in g) for g in (grid_thw.tolist() if torch.is_tensor(grid_thw) else grid_thw)]


def run_tower(vcfg: VisionConfig, pixel_values: torch.Tensor, grid_thw, fetch, *, dtype: torch.dtype,
              attn_mem_cap: int = DEFAULT_ATTN_MEM_CAP, rows: int | None = None, done=None) -> torch.Tensor:
    """The tower over weights handed out group by group (see `vision_groups`).

    fetch(group, x) -> (weights of the group under local names, x): the group's weights and the
    activations on the device the group runs on (x is None for "vision.embed": the pixels are moved
    there instead); done(group) is called once the group's compute is issued (its weights may then be
    reused). The rotary tables follow x when a group moves it. `rows` caps the rows of each block's
    row-wise work (see `vision_block`)."""
    grids = _grid_list(grid_thw)
    unit = vcfg.merge_unit
    n = pixel_values.shape[0]
    if n != sum(t * h * w for t, h, w in grids):
        raise ValueError(f"pixel_values has {n} patches, the grids {grids} need {sum(t * h * w for t, h, w in grids)}")
    order, window_lengths = window_order(grids, vcfg)
    patch_order = (order[:, None] * unit + torch.arange(unit)[None, :]).reshape(-1)
    full_lengths = image_lengths(grids)
    cos, sin = vision_rotary(patch_positions(grids, vcfg.spatial_merge_size), vcfg)
    cos, sin = cos[patch_order], sin[patch_order]

    w, _ = fetch("vision.embed", None)
    dev = w["patch_embed.weight"].device
    pe = w["patch_embed.weight"].reshape(vcfg.hidden_size, -1)
    if rows is None or rows >= n:
        x = F.linear(pixel_values.to(device=dev, dtype=dtype), pe)
    else:                      # the pixels cross to the device a chunk at a time
        x = torch.empty(n, vcfg.hidden_size, dtype=dtype, device=dev)
        for a in range(0, n, rows):
            x[a:a + rows] = F.linear(pixel_values[a:a + rows].to(device=dev, dtype=dtype), pe)
    x = x[patch_order.to(dev)]
    del pe, w
    if done is not None:
        done("vision.embed")
    full = set(vcfg.fullatt_block_indexes)
    for i in range(vcfg.depth):
        group = f"vision.blocks.{i}"
        w, x = fetch(group, x)
        if cos.device != x.device:
            cos, sin = cos.to(x.device), sin.to(x.device)
        x = vision_block(vcfg, w, x, cos, sin, full_lengths if i in full else window_lengths, attn_mem_cap, rows)
        del w
        if done is not None:
            done(group)
    del cos, sin
    w, x = fetch("vision.merger", x)
    merged = merge_patches(vcfg, w, x, rows)
    del w, x
    if done is not None:
        done("vision.merger")
    return merged[torch.argsort(order.to(merged.device))]


def encode_pixels(weights: dict[str, torch.Tensor], vcfg: VisionConfig, pixel_values: torch.Tensor,
                  grid_thw, *, device=None, dtype: torch.dtype | None = None,
                  attn_mem_cap: int = DEFAULT_ATTN_MEM_CAP, rows: int | None = None) -> torch.Tensor:
    """pixel_values [n_patches, C*T*P*P] + grids -> embeddings [n_patches / merge^2, out_hidden] (all
    images concatenated, in image order) on `device`. Weights may live on the CPU: each block's are
    copied to `device` when it runs and dropped after."""
    embed_w = weights["vision.patch_embed.weight"]
    device = torch.device(device) if device is not None else embed_w.device
    dtype = dtype or embed_w.dtype

    def fetch(group: str, x):
        if group == "vision.embed":
            return {"patch_embed.weight": embed_w.to(device=device, dtype=dtype)}, x
        return _local(weights, group + ".", device, dtype), x

    return run_tower(vcfg, pixel_values, grid_thw, fetch, dtype=dtype, attn_mem_cap=attn_mem_cap, rows=rows)


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


__all__ = ["DEFAULT_ATTN_MEM_CAP", "VisionConfig", "attention_scores_bytes", "attention_tiling",
           "attention_work_bytes", "encode_images", "encode_pixels", "merge_patches", "run_tower",
           "segmented_attention", "vision_block", "vision_groups", "vision_weight_names", "vision_weight_shapes"]
