"""The Qwen2-VL / Qwen2.5-VL image processor: PIL image -> flattened patches + (t, h, w) grid.

Matches transformers' `Qwen2VLImageProcessor` (PIL backend) step by step:
1. convert to RGB, compositing any transparency onto white;
2. `smart_resize`: round each side to a multiple of patch_size * merge_size, then scale uniformly into
   [min_pixels, max_pixels] (an image below min_pixels is upscaled, so even 1x1 becomes 56x56);
3. bicubic resize with PIL on the uint8 image;
4. rescale by 1/255 (in float64, then float32) and normalise with the CLIP mean/std in float32;
5. cut into patch_size x patch_size patches ordered merge-block by merge-block, duplicate each patch
   temporal_patch_size times (a still image is a 2-frame clip), flatten to [n_patches, C*T*P*P].
Each image gives grid (1, H/patch, W/patch) and grid_h * grid_w / merge^2 language-model tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import BadInputError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_convert_rgb: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = 3                # PIL.Image.BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after the Qwen2-VL resizing rules: both multiples of `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise BadInputError(f"image {width}x{height}: aspect ratio over 200:1 is not supported")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def to_rgb(image):
    """A PIL image in RGB; transparency is composited onto a white background (as the reference)."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def grid_for_size(height: int, width: int, pcfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """The (t, h, w) patch grid an image of this size gets (without decoding it)."""
    rh, rw = smart_resize(height, width, pcfg.factor, pcfg.min_pixels, pcfg.max_pixels)
    return 1, rh // pcfg.patch_size, rw // pcfg.patch_size


def image_token_count(grid_thw, merge_size: int) -> int:
    """Language-model tokens for one image: t * h * w / merge^2."""
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def preprocess_image(image, pcfg: ImageProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One PIL image -> (patches float32 [h*w, C*T*P*P], (1, h, w))."""
    from PIL import Image

    if pcfg.do_convert_rgb:
        image = to_rgb(image)
    arr = np.asarray(image)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    height, width = arr.shape[:2]
    rh, rw = smart_resize(height, width, pcfg.factor, pcfg.min_pixels, pcfg.max_pixels)
    pil = Image.fromarray(arr[:, :, 0] if arr.shape[2] == 1 else arr)
    arr = np.asarray(pil.resize((rw, rh), resample=pcfg.resample))
    if arr.ndim == 2:
        arr = arr[:, :, None]
    x = arr
    if pcfg.do_rescale:
        x = (x.astype(np.float64) * pcfg.rescale_factor).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if pcfg.do_normalize:
        mean = np.asarray(pcfg.image_mean, dtype=np.float32)
        std = np.asarray(pcfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    return _patchify(x, pcfg), (1, rh // pcfg.patch_size, rw // pcfg.patch_size)


def _patchify(x: np.ndarray, pcfg: ImageProcessorConfig) -> torch.Tensor:
    """[H, W, C] float32 -> [gh*gw, C*T*P*P], patches in merge-block order (block row, block col,
    row in block, col in block), each patch channel-major and repeated T times."""
    height, width, channels = x.shape
    p, m, t = pcfg.patch_size, pcfg.merge_size, pcfg.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = x.reshape(gh // m, m, p, gw // m, m, p, channels)
    # -> (block row, block col, row in block, col in block, channel, pixel row, pixel col)
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return torch.from_numpy(np.ascontiguousarray(frames).reshape(gh * gw, channels * t * p * p))


def preprocess_images(images, pcfg: ImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL images -> (pixel_values float32 [sum of patches, C*T*P*P], image_grid_thw int64 [n, 3])."""
    patches, grids = [], []
    for image in images:
        pv, grid = preprocess_image(image, pcfg)
        patches.append(pv)
        grids.append(grid)
    return torch.cat(patches, dim=0), torch.tensor(grids, dtype=torch.long)
