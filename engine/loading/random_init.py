"""Random-weight models of a given shape, for benchmarks (speed does not depend on the weights' values).

Weights are drawn on the GPU where one is present (much faster than on the CPU) and returned as CPU
tensors, like any loader's. The tokenizer maps bytes to ids, enough to feed prompts of known lengths.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig, weight_names, weight_shape
from engine.loading.loaded import LoadedModel

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (ids past 255 decode to nothing)."""

    bos_token_id = None
    add_bos = False

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_ids: set[int] = set()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if add_generation_prompt else "")


def random_model(cfg: ModelConfig, seed: int = 0, name: str = "random") -> LoadedModel:
    dtype = _DTYPES[cfg.dtype]
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=gen_device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for names in weight_names(cfg).values():
        for n in names:
            if n in weights:
                continue
            shape = weight_shape(cfg, n)
            if n.endswith("norm.weight"):
                weights[n] = torch.ones(shape, dtype=dtype)
                continue
            t = torch.randn(shape, generator=g, device=gen_device, dtype=torch.float32 if gen_device == "cpu"
                            else dtype)
            weights[n] = (t * 0.02).to(dtype).cpu()
    return LoadedModel(cfg, weights, ByteTokenizer(cfg.vocab_size), name, "random", cfg.dtype)
