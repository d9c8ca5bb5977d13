"""Shared by the vision tests: test pictures and the tiny Qwen2.5-VL (ours loaded, and transformers')."""

from __future__ import annotations

import numpy as np
import pytest
import torch

SIZES = [(123, 77), (300, 500), (640, 200)]      # (width, height)


def picture(width, height, seed=0):
    """A random RGB picture (the same one for the same arguments)."""
    from PIL import Image

    rng = np.random.default_rng(seed + width * 7 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def loaded(folder):
    from engine.loading.hf_vision import load_hf_vl

    return load_hf_vl(folder)


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
