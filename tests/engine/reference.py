"""The outside reference for the fidelity tests: transformers' own logits, and the error measure."""

from __future__ import annotations

import torch


def transformers_logits(path, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Teacher-forced logits [len(ids), vocab] (as float32) of the Hugging Face folder at `path`, run by
    transformers in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref|."""
    return ((got - ref).abs().max() / ref.abs().max()).item()
