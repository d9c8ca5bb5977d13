"""What a loader hands the engine: config, weights by canonical name, tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import ModelConfig


class Tokenizer(Protocol):
    """The engine's tokenizer interface (`eng.tokenizer`)."""

    bos_token_id: int | None
    eos_token_ids: set[int]
    add_bos: bool            # whether a plain prompt starts with BOS (as the model was trained)
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str: ...


@dataclass
class LoadedModel:
    config: ModelConfig
    # Canonical names (engine.config.weight_names), CPU tensors at the precision given: bf16/fp16/fp32
    # as stored; GGUF quantized types dequantized to float32, and a GGUF's 16-bit tensor of another type
    # than config.dtype widened to float32 (engine.loading.gguf_file). A tied head has no "head.weight".
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    source: str              # the path it came from
    fmt: str                 # "hf" | "gguf"
    file_type: str           # what the file stores, e.g. "bf16", "Q4_1" (for reports)
