"""The Qwen2.5-VL vision tower as plain functions: embeddings equal transformers' model.visual on the
tiny model (windowed and full-attention blocks, several image shapes), and attention stays under its
memory cap (query tiling) with the same result."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tests.engine.vision_fixtures as vf
from engine.models.vision import qwen2_5_vl_tower as tower
from engine.models.vision.qwen2_5_vl_processor import preprocess_images
from engine.models.vision.qwen2_5_vl_tower import (
    encode_images,
    encode_pixels,
    segmented_attention,
    window_order,
)

folder, loaded, reference = vf.folder, vf.loaded, vf.reference   # shared module-scoped fixtures
SIZES = vf.SIZES
_image = vf.picture

TOLERANCE = 1e-4                                  # max |ours - reference| / max |reference|


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_embeddings_equal_reference(loaded, reference, width, height):
    pixel_values, grid = preprocess_images([_image(width, height)], loaded.vision.processor)
    _, lengths = window_order(grid.tolist(), loaded.vision)
    assert len(lengths) > 1, "window attention must really split the image"
    with torch.no_grad():
        ref = reference.model.visual(pixel_values, grid_thw=grid).pooler_output
    ours = encode_pixels(loaded.vision_weights, loaded.vision, pixel_values, grid)
    assert ours.shape == ref.shape == (int(grid.prod()) // 4, loaded.config.hidden_size)
    assert _rel(ours, ref) < TOLERANCE


def test_several_images_at_once_and_tiled_queries_equal_reference(loaded, reference):
    images = [_image(w, h) for w, h in SIZES]
    pixel_values, grid = preprocess_images(images, loaded.vision.processor)
    with torch.no_grad():
        ref = reference.model.visual(pixel_values, grid_thw=grid).pooler_output
    for cap in (tower.DEFAULT_ATTN_MEM_CAP, 4096, 1):     # 1 byte: one query row per SDPA call
        ours = encode_pixels(loaded.vision_weights, loaded.vision, pixel_values, grid, attn_mem_cap=cap)
        assert _rel(ours, ref) < TOLERANCE, cap


def test_encode_images_api_splits_per_image(loaded, reference, tmp_path):
    images = [_image(w, h) for w, h in SIZES]
    path = tmp_path / "first.png"
    images[0].save(path)
    import io

    buf = io.BytesIO()
    images[1].save(buf, format="PNG")
    out = encode_images(loaded.vision_weights, loaded.vision, [path, buf.getvalue(), images[2]], "cpu")
    pixel_values, grid = preprocess_images(images, loaded.vision.processor)
    with torch.no_grad():
        ref = reference.model.get_image_features(pixel_values, image_grid_thw=grid).pooler_output
    assert [t.shape[0] for t in out] == [r.shape[0] for r in ref] == [int(g.prod()) // 4 for g in grid]
    for ours, theirs in zip(out, ref):
        assert _rel(ours, theirs) < TOLERANCE


def test_attention_respects_the_memory_cap(monkeypatch):
    torch.manual_seed(0)
    heads, d = 2, 16
    lengths = [64, 64, 64, 16, 16, 200, 8]
    n = sum(lengths)
    q, k, v = (torch.randn(heads, n, d) for _ in range(3))
    expected = torch.empty_like(q)
    start = 0
    for seg in lengths:
        s = slice(start, start + seg)
        scores = (q[:, s] @ k[:, s].transpose(-1, -2)) / d ** 0.5
        expected[:, s] = scores.softmax(-1) @ v[:, s]
        start += seg
    real_sdpa = F.scaled_dot_product_attention
    for cap in (10**9, 64 * 1024, 3000):
        seen = []

        def spy(qq, kk, vv, *a, seen=seen, **kw):
            seen.append(qq.shape[0] * qq.shape[1] * qq.shape[2] * kk.shape[2] * 4)
            return real_sdpa(qq, kk, vv, *a, **kw)

        monkeypatch.setattr(tower.F, "scaled_dot_product_attention", spy)
        out = segmented_attention(q, k, v, lengths, mem_cap=cap)
        monkeypatch.setattr(tower.F, "scaled_dot_product_attention", real_sdpa)
        assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
        # A call never builds more scores than the cap, unless one query row alone is over it.
        assert max(seen) <= max(cap, heads * max(lengths) * 4)
        if cap >= 10**9:
            assert len(seen) == len(set(lengths)), "same-length windows run as one batched call"


def test_window_order_matches_reference():
    from transformers.vision_utils import get_vision_window_index

    vcfg = tower.VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                              window_size=112)
    grids = [[1, 20, 12], [1, 16, 16], [1, 6, 34], [2, 8, 8]]
    ref_index, ref_cu = get_vision_window_index(torch.tensor(grids), 2, 112, 14)
    order, lengths = window_order(grids, vcfg)
    assert torch.equal(order, ref_index)
    assert np.cumsum([0] + lengths).tolist() == ref_cu.tolist()


def test_1440p_scale_attention_has_no_full_score_matrix(monkeypatch):
    # A 1440p-sized image at the real processor limits: 2548x1428 px -> 182x102 patches = 18564 tokens.
    # Under the cap, no SDPA call builds more scores than the cap (the real tower's full N x N over 16
    # heads would be 22 GB). Two heads and a 32 MB cap keep the test light; the mechanism is the same.
    n = 182 * 102
    real = tower.VisionConfig(depth=1, hidden_size=1280, num_heads=16, intermediate_size=64, out_hidden_size=64)
    assert real.num_heads * n * n * 4 > 20 * 2**30
    assert tower.attention_scores_bytes(n, real) <= tower.DEFAULT_ATTN_MEM_CAP
    cap = 32 * 2**20
    seen = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(qq, kk, vv, *a, **kw):
        seen.append(qq.shape[0] * qq.shape[1] * qq.shape[2] * kk.shape[2] * 4)
        return real_sdpa(qq, kk, vv, *a, **kw)

    monkeypatch.setattr(tower.F, "scaled_dot_product_attention", spy)
    q = torch.randn(2, n, 2)          # head dim 2 keeps this test light
    segmented_attention(q, q, q, [n], mem_cap=cap)
    assert seen and max(seen) <= cap
