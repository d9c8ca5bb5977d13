"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL, and prompts with image tokens.

Every token has three position ids (temporal, height, width). Text tokens use the same value on all
three, counting up by one. The tokens of an image (a t x h x w grid of merged patches, in raster
order) get (start + t_i, start + h_i, start + w_i), where start is the position after the preceding
text; the text after the image continues from start + max(h, w) of the merged grid (for a still image,
the largest image position + 1). During decoding, token i of the sequence has position i + delta on all three
axes, delta = (largest prompt position + 1) - prompt length.

The rotary angles split the head's frequency slots into `mrope_section` (e.g. [16, 24, 24] for a
128-dim head): the first section rotates by the temporal position, the next by the height, the last
by the width; the result is the usual rotate-half cos/sin of shape [n, head_dim].
"""

from __future__ import annotations

import copy

import torch

from engine.errors import BadInputError

IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
IMAGE_PLACEHOLDER = VISION_START + IMAGE_PAD + VISION_END


def mrope_positions(input_ids, image_token_id: int, grids_thw, merge_size: int) -> tuple[torch.Tensor, int]:
    """(positions int64 [3, n], delta) for one prompt. `grids_thw`: the (t, h, w) patch grid of each
    image, in the order the images appear; each image's tokens are t*h*w/merge^2 consecutive
    `image_token_id`s."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(-1)
    n = ids.numel()
    is_image = (ids == image_token_id).tolist()
    grids = [tuple(int(v) for v in g) for g in (grids_thw.tolist() if torch.is_tensor(grids_thw) else grids_thw)]
    counts = [t * (h // merge_size) * (w // merge_size) for t, h, w in grids]
    if sum(is_image) != sum(counts):
        raise BadInputError(f"the prompt has {sum(is_image)} image tokens but the {len(grids)} images "
                            f"need {sum(counts)}")
    pieces: list[torch.Tensor] = []
    pos, i, image = 0, 0, 0
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            pieces.append((torch.arange(j - i, dtype=torch.long) + pos).expand(3, -1))
            pos += j - i
            i = j
            continue
        t, h, w = grids[image]
        gh, gw = h // merge_size, w // merge_size
        if not all(is_image[i:i + counts[image]]):
            raise BadInputError(f"image {image}: its {counts[image]} image tokens are not consecutive in the prompt")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        pos += max(gh, gw)
        i += counts[image]
        image += 1
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - n) if n else 0
    return positions, delta


def decode_positions(start: int, count: int, delta: int) -> torch.Tensor:
    """Positions int64 [3, count] of sequence tokens start .. start+count-1 after a multimodal prompt."""
    return (torch.arange(start, start + count, dtype=torch.long) + delta).expand(3, -1).contiguous()


def text_inverse_frequencies(head_dim: int, rope_theta: float) -> torch.Tensor:
    """The language model's inverse frequencies [head_dim/2] (plain RoPE, as Qwen2.5-VL uses)."""
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def mrope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mrope_section, *,
                  device=None, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """positions int64 [3, n] (or [n] for plain text) -> (cos, sin) each [n, head_dim] in `dtype`."""
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    section = [int(s) for s in mrope_section]
    if sum(section) != inv_freq.numel():
        raise ValueError(f"mrope_section {section} does not sum to head_dim/2 = {inv_freq.numel()}")
    freqs = positions.float()[..., None] * inv_freq.float()[None, None, :]     # [3, n, head_dim/2]
    parts = [chunk[k % 3] for k, chunk in enumerate(freqs.split(section, dim=-1))]
    freqs = torch.cat(parts, dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


class MRotaryTable:
    """Like `engine.models.rope.RotaryTable`, for M-RoPE: cos_sin takes [3, n] positions (or [n])."""

    def __init__(self, head_dim: int, rope_theta: float, mrope_section):
        self.inv_freq = text_inverse_frequencies(head_dim, rope_theta)
        self.mrope_section = tuple(int(s) for s in mrope_section)

    def cos_sin(self, positions: torch.Tensor, device, dtype):
        return mrope_cos_sin(positions, self.inv_freq, self.mrope_section, device=device, dtype=dtype)


# ---- prompts -------------------------------------------------------------------------------------

def _is_image_part(part) -> bool:
    return isinstance(part, dict) and (part.get("type") == "image" or "image" in part)


def _count_image_parts(messages) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if _is_image_part(p))


def place_images(messages: list[dict], n_images: int) -> list[dict]:
    """Messages whose content lists hold exactly `n_images` {"type": "image"} parts: as given when
    they already do; when they hold none, the images go before the last user message's text."""
    found = _count_image_parts(messages)
    if found == n_images:
        return messages
    if found:
        raise BadInputError(f"the messages have {found} image parts but {n_images} images were given")
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise BadInputError("images were given but there is no user message to attach them to")
    out = copy.deepcopy(messages)
    last = out[users[-1]]
    content = last.get("content")
    parts = content if isinstance(content, list) else [{"type": "text", "text": content or ""}]
    last["content"] = [{"type": "image"} for _ in range(n_images)] + list(parts)
    return out


def _flatten(messages: list[dict]) -> list[dict]:
    """Content lists -> strings, image parts as the placeholder text (for templates without images)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            text = "".join(IMAGE_PLACEHOLDER if _is_image_part(p) else str(p.get("text", ""))
                           if isinstance(p, dict) else str(p) for p in content)
            m = {**m, "content": text}
        out.append(m)
    return out


def build_prompt_ids(tokenizer, messages, image_token_counts, *, add_generation_prompt: bool = True,
                     image_token: str = IMAGE_PAD) -> list[int]:
    """Token ids of a chat (messages) or plain prompt (a str with one `<|image_pad|>` per image) with
    each image's pad token repeated image_token_counts[i] times, as the reference processor expands it.

    Images go where a message's content list has {"type": "image"} parts, else before the last user
    message's text. A chat template that does not render image parts gets them as
    "<|vision_start|><|image_pad|><|vision_end|>" text in the message.
    """
    counts = [int(c) for c in image_token_counts]
    pad_id = tokenizer.token_to_id(image_token)
    if pad_id is None:
        raise BadInputError(f"the tokenizer has no '{image_token}' token: this model does not take images")
    if isinstance(messages, str):
        text = messages
    else:
        msgs = place_images(list(messages), len(counts)) if counts else list(messages)
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        if text.count(image_token) != len(counts):
            text = tokenizer.apply_chat_template(_flatten(msgs), add_generation_prompt=add_generation_prompt)
    ids = tokenizer.encode(text, add_special_tokens=False)
    found = ids.count(pad_id)
    if found != len(counts):
        raise BadInputError(f"the prompt has {found} '{image_token}' tokens but {len(counts)} images were given")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == pad_id:
            out.extend([pad_id] * counts[k])
            k += 1
        else:
            out.append(t)
    return out
