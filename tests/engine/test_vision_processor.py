"""Qwen2.5-VL image input and processor: decoding errors are one-liners; pixel_values, grids and token
counts equal transformers' Qwen2VLImageProcessor (the PIL backend) on images of several shapes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from engine.errors import BadInputError
from engine.models.vision.image_input import load_image
from engine.models.vision.qwen2_5_vl_processor import (
    ImageProcessorConfig,
    image_token_count,
    preprocess_images,
    smart_resize,
)

SIZES = [(123, 77), (300, 500), (640, 200)]      # (width, height): landscape, portrait, wide


def _image(width, height, mode="RGB", seed=0):
    from PIL import Image

    rng = np.random.default_rng(seed + width * 7 + height)
    channels = 4 if mode == "RGBA" else 3
    img = Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8),
                          "RGBA" if mode == "RGBA" else "RGB")
    return img if mode in ("RGB", "RGBA") else img.convert(mode)


def _encoded(img, fmt="PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def pcfg(folder):
    from engine.loading.hf_vision import read_vl_config

    return read_vl_config(folder)[1].processor


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_pixel_values_grid_and_tokens_equal_reference(reference, pcfg, width, height):
    img = _image(width, height)
    ref = reference(images=[img], return_tensors="pt")
    pixel_values, grid = preprocess_images([img], pcfg)
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert pixel_values.dtype == torch.float32
    assert pixel_values.shape == ref["pixel_values"].shape
    assert torch.equal(pixel_values, ref["pixel_values"].float())
    assert image_token_count(grid[0], pcfg.merge_size) == int(ref["image_grid_thw"][0].prod()) // 4
    assert image_token_count(grid[0], pcfg.merge_size) == \
        reference.get_number_of_image_patches(height, width) // 4


def test_batch_of_mixed_modes_equals_reference(reference, pcfg):
    images = [_image(200, 120, "RGBA"), _image(90, 160, "L"), _image(150, 150, "P"), _image(1, 1)]
    ref = reference(images=images, return_tensors="pt")
    pixel_values, grid = preprocess_images(images, pcfg)
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert torch.equal(pixel_values, ref["pixel_values"].float())


def test_downscale_above_max_pixels_equals_reference(reference, pcfg):
    img = _image(1000, 700)          # 700k pixels, over the tiny processor's max_pixels
    ref = reference(images=[img], return_tensors="pt")
    pixel_values, grid = preprocess_images([img], pcfg)
    assert grid.tolist() == ref["image_grid_thw"].tolist()
    assert int(grid[0].prod()) * 14 * 14 <= pcfg.max_pixels
    assert torch.equal(pixel_values, ref["pixel_values"].float())


def test_smart_resize_equals_reference():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref_resize

    rng = np.random.default_rng(1)
    for h, w in [(1, 1), (1, 3), (28, 28), (2560, 1440), (1440, 2560), (10, 1999), (4000, 3000)] + \
            [tuple(int(v) for v in rng.integers(1, 3000, 2)) for _ in range(200)]:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in [(56 * 56, 28 * 28 * 1280), (56 * 56, 28 * 28 * 64), (3136, 12845056)]:
            assert smart_resize(h, w, 28, lo, hi) == ref_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_one_pixel_image_is_upscaled_like_the_reference(pcfg):
    # The reference upscales anything below min_pixels: a 1x1 image becomes 56x56 (4x4 patches, 4 tokens).
    img = load_image(_encoded(_image(1, 1)))
    _, grid = preprocess_images([img], pcfg)
    assert grid.tolist() == [[1, 4, 4]]
    assert image_token_count(grid[0], 2) == 4


def test_load_image_accepts_path_bytes_and_pil(tmp_path):
    img = _image(40, 30)
    path = tmp_path / "a.png"
    img.save(path)
    for source in (str(path), path, path.read_bytes(), bytearray(path.read_bytes()), img):
        out = load_image(source)
        assert out.size == (40, 30)
        assert np.array_equal(np.asarray(out.convert("RGB")), np.asarray(img))


def _one_line(exc_info, *words):
    msg = str(exc_info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg.lower(), msg


def test_not_an_image():
    with pytest.raises(BadInputError) as e:
        load_image(b"this is plain text, not a picture")
    _one_line(e, "not an image")


def test_empty_bytes_and_missing_file_and_wrong_type(tmp_path):
    with pytest.raises(BadInputError) as e:
        load_image(b"")
    _one_line(e, "empty")
    with pytest.raises(BadInputError) as e:
        load_image(tmp_path / "nope.png")
    _one_line(e, "no such file", "nope.png")
    with pytest.raises(BadInputError) as e:
        load_image(12345)
    _one_line(e, "expected a file path")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_image(fmt, tmp_path):
    data = _encoded(_image(200, 150), fmt)
    path = tmp_path / f"cut.{fmt.lower()}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadInputError) as e:
        load_image(path, index=2)
    _one_line(e, "image 2", "cut.")


def test_decompression_bomb_over_the_pixel_limit():
    from PIL import Image

    bomb = _encoded(Image.new("1", (8000, 7000)))         # 56 MP of one colour: a few KB of PNG
    with pytest.raises(BadInputError) as e:
        load_image(bomb)
    _one_line(e, "8000x7000", "megapixel limit")
    with pytest.raises(BadInputError) as e:
        load_image(Image.new("1", (8000, 7000)))
    _one_line(e, "megapixel limit")


def test_pils_own_bomb_error_becomes_our_message(monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)   # PIL raises past twice this, on open
    with pytest.raises(BadInputError) as e:
        load_image(_encoded(_image(100, 100)), max_pixels=10**9)
    _one_line(e, "megapixel limit")


def test_extreme_aspect_ratio_is_refused():
    from PIL import Image

    with pytest.raises(BadInputError) as e:
        load_image(_encoded(Image.new("RGB", (1000, 2))))
    _one_line(e, "aspect ratio", "1000x2")


def test_processor_defaults_are_the_references():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil()
    ours = ImageProcessorConfig()
    assert (ours.min_pixels, ours.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])
    assert (ours.patch_size, ours.temporal_patch_size, ours.merge_size) == (
        ref.patch_size, ref.temporal_patch_size, ref.merge_size)
    assert list(ours.image_mean) == list(ref.image_mean) and list(ours.image_std) == list(ref.image_std)
