"""Llama-3 RoPE scaling <-> per-frequency factors (GGUF's `rope_freqs.weight`).

llama.cpp's converter stores Llama-3.x rope scaling as one divisor per rotary frequency instead of the
Hugging Face parameters. `llama3_factors` computes those divisors from the parameters;
`llama3_scaling_from_factors` recovers parameters that reproduce the stored divisors. (Only the ratios
of original_max_position_embeddings, low_freq_factor and high_freq_factor matter, so low_freq_factor is
fixed at 1.0 when it cannot be told apart.)
"""

from __future__ import annotations

import math

import torch


def llama3_factors(scaling: dict, head_dim: int, rope_theta: float) -> torch.Tensor:
    """Divisor of each rotary frequency under llama3 scaling (what the converter writes)."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def llama3_scaling_from_factors(factors: torch.Tensor, head_dim: int, rope_theta: float) -> dict | None:
    """HF llama3 rope_scaling reproducing `factors`; {} when all are 1 (no scaling); None if no fit."""
    r = factors.double().flatten()
    if r.numel() != head_dim // 2:
        return None
    factor = float(r.max())
    if torch.allclose(r, torch.ones_like(r), atol=1e-6):
        return {}
    wavelen = 2 * math.pi * rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ones, full = r <= 1 + 1e-6, r >= factor * (1 - 1e-6)
    mid = ~(ones | full)
    # smooth = (1/r - 1/factor) / (1 - 1/factor) = (old/wavelen - low) / (high - low)
    smooth = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
    x = 1 / wavelen[mid]
    if mid.sum() >= 2:
        a, b = torch.linalg.lstsq(torch.stack([x, torch.ones_like(x)], 1), smooth[:, None]).solution[:, 0]
        if b >= 0:
            return None
        # a = old / (high - low), b = -low / (high - low); take low = 1
        span = -1 / float(b)
        old, low, high = float(a) * span, 1.0, 1.0 + span
    else:
        # Too few points to measure: choose thresholds that classify every frequency as stored.
        w_one = float(wavelen[ones].max()) if ones.any() else 0.0
        w_full = float(wavelen[full].min()) if full.any() else float(wavelen.max()) * 2
        w_mid = float(wavelen[mid].max()) if mid.any() else w_one
        old = math.sqrt(max(w_mid, w_one, 1e-9) * w_full)   # low_wavelen = old (low = 1)
        if mid.any():
            high = 1 + (old / w_mid - 1) / float(smooth[0])
        else:
            high = (1 + old / max(w_one, 1e-9)) / 2
        low = 1.0
    scaling = {"rope_type": "llama3", "factor": _snap(factor), "low_freq_factor": low,
               "high_freq_factor": _snap(high), "original_max_position_embeddings": _snap(old)}
    if not high > low or not torch.allclose(llama3_factors(scaling, head_dim, rope_theta).double(), r,
                                            rtol=1e-4, atol=1e-5):
        return None
    return scaling


def _snap(x: float) -> float | int:
    """8191.9998 -> 8192 (the fit's rounding noise), else x unchanged."""
    near = round(x)
    return near if abs(x - near) < 1e-4 * max(1.0, abs(x)) else x
