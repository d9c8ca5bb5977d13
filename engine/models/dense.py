"""The dense transformer's sub-layers as plain functions over a dict of weights.

`attention_block` and `ffn_block` each take the residual stream `x` [n, hidden] and return it updated;
they run on whatever device their weights and `x` are on, so the executor can place each one freely.
Weight dicts use the sub-layer's local names ("q.weight", "gate.weight", ...).

The residual stream runs in the model's compute dtype (`ModelConfig.dtype`); a weight is either in that
dtype or wider (float32: a GGUF file keeps its norms, biases and MoE routers in F32 next to F16/BF16
matrices). A wider weight runs at its own precision and every block hands back the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import ModelConfig
from engine.models.rope import apply_rotary


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the native CPU kernel for the few-row matmuls of decode (see engine.kernels).
    A weight or bias of another dtype than `x` (float32 next to 16-bit activations) runs at its own
    precision; the result has `x`'s dtype."""
    if w.dtype != x.dtype or (b is not None and b.dtype != w.dtype):
        y = linear(x.to(w.dtype), w)
        return (y if b is None else y + b).to(x.dtype)
    if x.device.type == "cpu":
        y = kernels.linear(x, w, b)
        if y is not None:
            return y
    return F.linear(x, w, b)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.device.type == "cpu":          # decode rows on the CPU: one native call (the same rounding steps)
        y = kernels.rms_norm(x, weight, eps)
        if y is not None:
            return y
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype != x.dtype:           # a float32 norm over 16-bit activations: scaled in float32
        return (weight.float() * x32).to(x.dtype)
    return weight * x32.to(x.dtype)


def attention_block(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, kv_write, kv_read, mask: torch.Tensor | None, attend=None) -> torch.Tensor:
    """Pre-norm self-attention with RoPE and a KV cache.

    kv_write(k, v): stores this step's keys/values ([kv_heads, n, head_dim] each).
    kv_read() -> (K, V): all cached keys/values including this step's, [kv_heads, L, head_dim].
    mask: see `attention_mask`: None, "causal", or bool [n, L] (True = may attend).
    attend(q, k, v) -> out [heads, n, head_dim], when given, replaces write, read and attention (a batched
    step: the projections run once over every sequence's tokens, attention per sequence).
    """
    q, k, v = attention_qkv(cfg, w, x, cos, sin)
    return attention_out(cfg, w, x, q, k, v, kv_write, kv_read, mask, attend)


def attention_qkv(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention block up to its cache: the norm, the projections, the q/k norms and RoPE. Returns q
    [heads, n, d] and k, v [kv_heads, n, d] (q and k rotated)."""
    n, d, nh = x.shape[0], cfg.head_dim, cfg.num_heads
    h = rms_norm(x, w["attn_norm.weight"], cfg.rms_norm_eps)
    if "qkv.weight" in w and (not cfg.attention_bias or "qkv.bias" in w):
        qkv = linear(h, w["qkv.weight"], w.get("qkv.bias"))
        v = qkv[:, cfg.q_size + cfg.kv_size:].reshape(n, cfg.num_kv_heads, d).transpose(0, 1)
        # Norms and RoPE over the query and key heads at once: the same arithmetic, one pass each
        qk = qkv[:, :cfg.q_size + cfg.kv_size].reshape(n, nh + cfg.num_kv_heads, d)
        if cfg.qk_norm:
            qk = _qk_normed(cfg, w, qk)
        qk = apply_rotary(qk.transpose(0, 1), cos, sin)
        return qk[:nh], qk[nh:], v
    q = linear(h, w["q.weight"], w.get("q.bias"))
    k = linear(h, w["k.weight"], w.get("k.bias"))
    v = linear(h, w["v.weight"], w.get("v.bias")).reshape(n, cfg.num_kv_heads, d).transpose(0, 1)
    q = q.reshape(n, nh, d).transpose(0, 1)
    k = k.reshape(n, cfg.num_kv_heads, d).transpose(0, 1)
    if cfg.qk_norm:
        q = rms_norm(q, w["q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, w["k_norm.weight"], cfg.rms_norm_eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def _qk_normed(cfg: ModelConfig, w, qk: torch.Tensor) -> torch.Tensor:
    """`rms_norm` of the query heads by q_norm and of the key heads by k_norm, [n, heads + kv_heads, d], in
    one pass: the same elementwise steps as two calls, with half the launches."""
    qw, kw = w["q_norm.weight"], w["k_norm.weight"]
    if qk.device.type == "cpu" and qk.is_contiguous():
        y = kernels.rms_norm(qk, qw, cfg.rms_norm_eps, kw, cfg.num_heads + cfg.num_kv_heads, cfg.num_heads)
        if y is not None:
            return y
    if qw.dtype != qk.dtype or kw.dtype != qk.dtype:
        nh = cfg.num_heads
        return torch.cat([rms_norm(qk[:, :nh], qw, cfg.rms_norm_eps), rms_norm(qk[:, nh:], kw, cfg.rms_norm_eps)], 1)
    x32 = qk.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).to(qk.dtype)
    out[:, :cfg.num_heads].mul_(qw)
    out[:, cfg.num_heads:].mul_(kw)
    return out


def attention_out(cfg: ModelConfig, w, x, q, k, v, kv_write, kv_read, mask, attend) -> torch.Tensor:
    """Attention of the rotated q [heads, n, d] over the cache with this step's k and v, then the output
    projection and the residual."""
    n = x.shape[0]
    if attend is not None:
        out = attend(q, k, v)
    else:
        kv_write(k, v)
        keys, values = kv_read()
        out = _attend(q, keys, values, mask, cfg.num_kv_heads != cfg.num_heads)
    out = out.transpose(0, 1).reshape(n, cfg.q_size)
    return x + linear(out, w["o.weight"])


def _attend(q, keys, values, mask, gqa: bool) -> torch.Tensor:
    """Scaled dot-product attention through PyTorch's fused kernels, never a full score matrix on the
    GPU: a causal step over an empty cache uses `is_causal` (flash); a masked step expands the KV heads
    (the memory-efficient kernel takes a mask but not grouped heads)."""
    q, keys, values = q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0)
    if isinstance(mask, str) and mask == "causal":
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)[0]
    if mask is None:
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)[0]
    if gqa and q.device.type == "cuda":
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None, None], enable_gqa=gqa)[0]


def attend_one_token(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """One new token's attention over a padded context: q [heads, 1, d], keys and values [kv_heads, L, d],
    `valid` bool [L] (the positions it may see). Each KV head's group of query heads goes in as that
    head's queries (they share one position, so one mask row serves them all): grouped heads without
    expanding the keys, in one fused kernel of static shapes (a CUDA graph captures it)."""
    return attend_one_token_batch(q.reshape(1, *q.shape[::2]), keys[None], values[None], valid[None]).reshape(q.shape)


def attend_one_token_batch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           valid: torch.Tensor) -> torch.Tensor:
    """`attend_one_token` for B sequences at once: q [B, heads, d], keys and values [B, kv_heads, L, d]
    (each sequence's context padded to L), valid bool [B, L]; returns [B, heads, d]. The same kernel
    over the same padded rows per sequence, so each row comes out as `attend_one_token` gives it alone."""
    b, kvh, length, d = keys.shape
    heads = q.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(b, kvh, heads // kvh, d), keys, values,
                                         attn_mask=valid.view(b, 1, 1, length))
    return out.reshape(b, heads, d)


def ffn_block(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Pre-norm SwiGLU feed-forward (a few rows on the CPU: one native call, `kernels.ffn_layer`, the same
    steps and bits)."""
    if x.device.type == "cpu":
        y = kernels.ffn_layer(x, w, cfg.rms_norm_eps)
        if y is not None:
            return y
    h = rms_norm(x, w["ffn_norm.weight"], cfg.rms_norm_eps)
    if "gate_up.weight" in w:
        gate, up = linear(h, w["gate_up.weight"]).chunk(2, dim=-1)
    else:
        gate, up = linear(h, w["gate.weight"]), linear(h, w["up.weight"])
    return x + linear(F.silu(gate) * up, w["down.weight"])


def ffn_hidden(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """silu(gate h) * up h over the intermediate rows a..b of a SwiGLU FFN, h being x normed: [t, b - a],
    rounded as `ffn_block` rounds (the rows of an FFN split between the CPU and the GPU)."""
    h = rms_norm(x, w["ffn_norm.weight"], cfg.rms_norm_eps)
    gu = w.get("gate_up.weight")
    if gu is not None:
        inter = gu.shape[0] // 2
        gate, up = gu[a:b], gu[inter + a:inter + b]
    else:
        gate, up = w["gate.weight"][a:b], w["up.weight"][a:b]
    return F.silu(linear(h, gate)) * linear(h, up)


def embed_tokens(w: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The embedding rows of `ids`, in `dtype` (the compute dtype) where given."""
    x = F.embedding(ids, w["embed.weight"])
    return x if dtype is None else x.to(dtype)


def output_head(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Final norm and the vocabulary projection; logits in float32 (at the head's precision where it is
    stored wider than the activations)."""
    h = rms_norm(x, w["norm.weight"], cfg.rms_norm_eps)
    head = w.get("head.weight")
    if head is None:
        head = w["embed.weight"]
    return linear(h.to(head.dtype), head).float()


def attention_mask(n_new: int, start: int, sliding_window: int | None, device):
    """What query i (position start+i) may see: None (everything: a single new token), "causal" (keys at
    positions <= its own over an empty cache), or a bool [n_new, start + n_new] mask (a cache already
    holds tokens, or a sliding window cuts in)."""
    total = start + n_new
    windowed = sliding_window is not None and total > sliding_window
    if n_new == 1 and not windowed:
        return None
    if start == 0 and not windowed:
        return "causal"
    q_pos = torch.arange(start, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask
