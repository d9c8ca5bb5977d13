"""One call from (messages, images) to what the language model needs for a multimodal prompt.

    vp = prepare_vision_prompt(vision_weights, vcfg, tokenizer, messages, images, device)
    x = embed_tokens(weights, ids)              # the engine's embedding of vp.ids
    x[vp.image_mask] = vp.embeddings            # image tokens take the vision tower's outputs
    cos, sin = mrope_cos_sin(vp.positions, inv_freq, vcfg.mrope_section)   # prefill rotary
    ... decode token at sequence index i: decode_positions(i, 1, vp.delta)

The vision tower runs to completion (its weights copied to `device` one block at a time and dropped)
before this returns, so its memory is free before the language model starts. The engine passes
`encoder` instead (`engine.models.vision.vision_pass.VisionPass`: the pass planned against its VRAM
budget, weights streamed through booked slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.vision.image_input import load_image
from engine.models.vision.mrope import build_prompt_ids, mrope_positions
from engine.models.vision.qwen2_5_vl_processor import image_token_count, preprocess_images
from engine.models.vision.qwen2_5_vl_tower import DEFAULT_ATTN_MEM_CAP, VisionConfig, encode_pixels


@dataclass
class VisionPrompt:
    ids: list[int]                 # the prompt's token ids, each image's pad token repeated per image token
    positions: torch.Tensor        # int64 [3, len(ids)]: M-RoPE (temporal, height, width) positions
    delta: int                     # a token at sequence index i >= len(ids) has position i + delta
    embeddings: torch.Tensor       # [sum of image tokens, hidden]: the images' embeddings, prompt order
    image_mask: torch.Tensor       # bool [len(ids)]: the rows `embeddings` replace
    grids: torch.Tensor            # int64 [n_images, 3]: each image's (t, h, w) patch grid
    token_counts: list[int]        # image tokens per image


def prepare_vision_prompt(vision_weights: dict[str, torch.Tensor], vcfg: VisionConfig, tokenizer, messages,
                          images, device=None, *, dtype: torch.dtype | None = None,
                          attn_mem_cap: int = DEFAULT_ATTN_MEM_CAP,
                          add_generation_prompt: bool = True, encoder=None) -> VisionPrompt:
    """Decode and preprocess `images` (paths, bytes, PIL images), run the vision tower, build the prompt
    ids from `messages` (a chat list, or a str with one "<|image_pad|>" per image) and its positions.
    `encoder(pixel_values, grids) -> embeddings` replaces `encode_pixels` over `vision_weights`; it runs
    after the prompt is built, so a bad prompt never costs a vision pass."""
    pil = [load_image(im, index=i) for i, im in enumerate(images)]
    pixel_values, grids = preprocess_images(pil, vcfg.processor)
    counts = [image_token_count(g, vcfg.spatial_merge_size) for g in grids.tolist()]
    ids = build_prompt_ids(tokenizer, messages, counts, add_generation_prompt=add_generation_prompt)
    positions, delta = mrope_positions(ids, vcfg.image_token_id, grids, vcfg.spatial_merge_size)
    if encoder is not None:
        embeddings = encoder(pixel_values, grids)
    else:
        embeddings = encode_pixels(vision_weights, vcfg, pixel_values, grids, device=device, dtype=dtype,
                                   attn_mem_cap=attn_mem_cap)
    mask = torch.tensor(ids) == vcfg.image_token_id
    return VisionPrompt(ids=ids, positions=positions, delta=delta, embeddings=embeddings, image_mask=mask,
                        grids=grids, token_counts=counts)
