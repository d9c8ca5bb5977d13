"""Images through the engine contract: `generate(..., images=[...])` on a tiny random Qwen2.5-VL gives
the same greedy tokens as transformers' own generate, on the CPU and on the simulated accelerator."""

from __future__ import annotations

import io
import os

import pytest
import torch

import engine
import tests.engine.vision_fixtures as vf
from engine.errors import BadInputError
from engine.models.vision.qwen2_5_vl_processor import image_token_count, preprocess_images

folder, reference = vf.folder, vf.reference   # shared module-scoped fixtures
SIZES = vf.SIZES
picture = vf.picture

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


def reference_greedy(reference, eng, image, n):
    ids = eng.encode_prompt(QUESTION, [image])
    eng._vision_prompts.clear()
    pixel_values, grids = preprocess_images([image], eng.vision.processor)
    with torch.no_grad():
        input_ids = torch.tensor([ids])
        # transformers 5 finds the image tokens through mm_token_type_ids (1 = image).
        mm = (input_ids == eng.vision.image_token_id).long()
        out = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 pixel_values=pixel_values, image_grid_thw=grids, mm_token_type_ids=mm,
                                 max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist(), ids, grids


@pytest.mark.parametrize("device", ["cpu", DEVICE])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_greedy_with_an_image_matches_transformers(folder, reference, device, size):
    eng = engine.open_model(folder, device=device, backend="torch", speculative=False)
    assert eng.supports_images
    image = picture(*size)
    want, ids, grids = reference_greedy(reference, eng, image, 12)
    n_image_tokens = sum(1 for t in ids if t == eng.vision.image_token_id)
    assert n_image_tokens == image_token_count(grids[0].tolist(), eng.vision.spatial_merge_size)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    for source in (image, buf.getvalue()):        # a PIL image, then the same picture as PNG bytes
        got = [e.token_id for e in eng.generate(QUESTION, images=[source], max_new_tokens=12)]
        assert got[:len(want)] == want
    eng.close()


def test_text_after_an_image_and_without_one(folder, reference):
    eng = engine.open_model(folder, device="cpu", backend="torch")
    plain = [{"role": "user", "content": "Hello there"}]
    ids = eng.encode_prompt(plain)
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = out[0, len(ids):].tolist()
    list(eng.generate(QUESTION, images=[picture(64, 64)], max_new_tokens=4))   # image blocks are not cached
    assert [e.token_id for e in eng.generate(plain, max_new_tokens=10)][:len(want)] == want


def test_bad_images_are_one_line_errors(folder, tmp_path):
    eng = engine.open_model(folder, device="cpu", backend="torch")
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    for bad in (str(text), b"\x89PNG\r\n\x1a\n" + b"\x00" * 20, str(tmp_path / "missing.png")):
        with pytest.raises(BadInputError) as exc:
            eng.generate(QUESTION, images=[bad], max_new_tokens=2)
        assert "\n" not in str(exc.value)
    assert list(eng.generate(QUESTION, images=[picture(32, 32)], max_new_tokens=2))[-1].finish_reason


def test_text_only_model_says_which_models_see_images(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="cpu", backend="torch")
    assert not eng.supports_images
    with pytest.raises(BadInputError, match="Qwen2.5-VL"):
        eng.generate("describe", images=[picture(32, 32)])
