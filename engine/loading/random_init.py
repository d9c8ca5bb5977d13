"""Random-weight models of a given shape, for benchmarks (speed does not depend on the weights' values,
except through a mixture of experts' routing: see `random_std`).

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


# Standard deviations of benchmark weights (`random_std`). With every matrix at 0.02, each attention's output
# (a projection of the values averaged over the context) far outweighs the token's own embedding in
# the residual stream: after a few layers every token carries nearly the same vector, and a MoE layer routes
# them all to the same few experts (a 4-layer Qwen3-30B-A3B shape, 256 random tokens: 36 of 128 experts
# touched at its last layer, the busiest by 251 of the tokens; `engine.bench.moe_routing`, whose record is
# docs/benchmarks/moe_routing/). A trained model spreads its tokens over the
# experts; a benchmark whose routing collapsed runs a small part of the expert weights and flatters prompts
# and batches. So the embedding is wide and the two projections that write into the residual stream
# (attention output, FFN down, an expert's down) are narrow: each token's embedding stays dominant and the
# routing random, as the engine's planner assumes it (`ModelSpec.expected_experts`).
EMBED_STD = 1.0
RESIDUAL_WRITE_STD = 0.001
WEIGHT_STD = 0.02
_EMBED_NAMES = ("embed.weight", "token_embd.weight", "embed_tokens.weight")
_WRITE_NAMES = ("o.weight", "down.weight", "attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight",
                "o_proj.weight", "down_proj.weight", "down_proj")


def random_std(name: str) -> float:
    """The standard deviation of random benchmark weight `name`, an engine, GGUF or transformers name."""
    leaf = name.rsplit(".", 2)
    tail = ".".join(leaf[-2:]) if len(leaf) > 1 else name
    if tail in _EMBED_NAMES:
        return EMBED_STD
    if tail in _WRITE_NAMES or leaf[-1] in _WRITE_NAMES:
        return RESIDUAL_WRITE_STD
    return WEIGHT_STD


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
            weights[n] = (t * random_std(n)).to(dtype).cpu()
    return LoadedModel(cfg, weights, ByteTokenizer(cfg.vocab_size), name, "random", cfg.dtype)
