"""Rotary position embeddings: inverse frequencies (plain, linear, llama3 scaling) and their application.

Matches the Hugging Face convention (rotate-half over the two halves of each head), computed in float32
and cast to the activations' dtype, as the reference does.
"""

from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from engine.errors import UnsupportedModelError


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, position scale) for the model's rope settings."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling_dict
    if not scaling:
        return inv, 1.0
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise UnsupportedModelError(f"rope_scaling.rope_type={kind!r}: not supported (default, linear, llama3)")


class RotaryTable:
    """cos/sin for positions, cached per device and dtype."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq, _ = inverse_frequencies(cfg)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, device: torch.device, dtype: torch.dtype):
        """positions: int64 [n] on CPU -> (cos, sin) each [n, head_dim] on `device` in `dtype`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, n, head_dim]; cos/sin [n, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
