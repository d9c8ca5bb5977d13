"""M-RoPE and prompts with images: positions equal transformers' get_rope_index, cos/sin equal its
rotary embedding, and the pieces together (prompt ids, vision embeddings in place of the image tokens,
the engine's dense blocks with M-RoPE) give the reference Qwen2.5-VL's logits, prefill and a decode step."""

from __future__ import annotations

import pytest
import torch

import tests.engine.vision_fixtures as vf
from engine.errors import BadInputError
from engine.models import dense
from engine.models.vision.mrope import (
    MRotaryTable,
    build_prompt_ids,
    decode_positions,
    mrope_cos_sin,
    mrope_positions,
    text_inverse_frequencies,
)
from engine.models.vision.pipeline import prepare_vision_prompt
from engine.models.vision.qwen2_5_vl_processor import image_token_count, preprocess_images
from engine.models.vision.qwen2_5_vl_tower import encode_images

folder, loaded, reference = vf.folder, vf.loaded, vf.reference   # shared module-scoped fixtures
SIZES = vf.SIZES
_image = vf.picture


def _messages(n_images: int, inline: bool = True):
    images = [{"type": "image"}] * n_images
    if inline and n_images >= 2:
        content = [images[0], {"type": "text", "text": "Compare this picture"}, *images[1:],
                   {"type": "text", "text": " with that one. What changed?"}]
    else:
        content = [*images, {"type": "text", "text": "What is in the picture?"}] if inline else \
            "What is in the picture?"
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": content}]


def _prompt(loaded, images, inline=True):
    _, grids = preprocess_images(images, loaded.vision.processor)
    counts = [image_token_count(g, 2) for g in grids.tolist()]
    ids = build_prompt_ids(loaded.tokenizer, _messages(len(images), inline), counts)
    return ids, grids, counts


def test_prompt_ids_expand_each_image(loaded):
    images = [_image(*SIZES[0]), _image(*SIZES[1])]
    ids, _, counts = _prompt(loaded, images)
    v = loaded.vision
    assert ids.count(v.image_token_id) == sum(counts)
    assert ids.count(v.vision_start_token_id) == ids.count(v.vision_end_token_id) == 2
    first = ids.index(v.vision_start_token_id)
    assert ids[first + 1:first + 1 + counts[0]] == [v.image_token_id] * counts[0]
    assert ids[first + 1 + counts[0]] == v.vision_end_token_id
    # The text equals the chat template's rendering with one pad per image.
    text = loaded.tokenizer.decode(ids, skip_special_tokens=False)
    assert "Compare this picture" in text and text.endswith("<|im_start|>assistant\n")


def test_images_without_image_parts_go_before_the_last_user_text(loaded):
    images = [_image(*SIZES[2])]
    placed, _, _ = _prompt(loaded, images, inline=False)
    explicit, _, _ = _prompt(loaded, images, inline=True)
    assert placed == explicit


def test_prompt_errors_are_one_line(loaded):
    with pytest.raises(BadInputError) as e:
        build_prompt_ids(loaded.tokenizer, _messages(2), [4])
    assert "2 image parts" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("n_images", [1, 2, 3])
def test_positions_equal_get_rope_index(loaded, reference, n_images):
    images = [_image(w, h) for w, h in SIZES[:n_images]]
    ids, grids, _ = _prompt(loaded, images)
    v = loaded.vision
    positions, delta = mrope_positions(ids, v.image_token_id, grids, v.spatial_merge_size)
    input_ids = torch.tensor([ids])
    ref_pos, ref_delta = reference.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == v.image_token_id).int(), image_grid_thw=grids)
    assert torch.equal(positions, ref_pos[:, 0])
    assert delta == int(ref_delta)
    assert torch.equal(decode_positions(len(ids), 3, delta),
                       (torch.arange(len(ids), len(ids) + 3) + ref_delta[0]).expand(3, -1))


def test_cos_sin_equal_reference_rotary(loaded, reference):
    ids, grids, _ = _prompt(loaded, [_image(*SIZES[1]), _image(*SIZES[2])])
    positions, _ = mrope_positions(ids, loaded.vision.image_token_id, grids, 2)
    cfg = loaded.config
    cos, sin = mrope_cos_sin(positions, text_inverse_frequencies(cfg.head_dim, cfg.rope_theta),
                             loaded.vision.mrope_section)
    x = torch.zeros(1, positions.shape[1], cfg.hidden_size)
    ref_cos, ref_sin = reference.model.language_model.rotary_emb(x, positions[:, None, :])
    assert torch.allclose(cos, ref_cos[0], atol=1e-6) and torch.allclose(sin, ref_sin[0], atol=1e-6)
    table = MRotaryTable(cfg.head_dim, cfg.rope_theta, loaded.vision.mrope_section)
    cos2, _ = table.cos_sin(positions, "cpu", torch.float32)
    assert torch.equal(cos2, cos)
    # Plain text positions ([n]) give ordinary RoPE.
    from engine.models.rope import RotaryTable

    plain = torch.arange(10)
    assert torch.allclose(table.cos_sin(plain, "cpu", torch.float32)[0],
                          RotaryTable(cfg).cos_sin(plain, "cpu", torch.float32)[0])


def _our_logits(loaded, ids, image_embeddings, positions):
    """The language model over a whole sequence with the engine's dense blocks and M-RoPE."""
    cfg, w = loaded.config, loaded.weights
    ids_t = torch.tensor(ids)
    x = dense.embed_tokens(w, ids_t)
    mask = ids_t == loaded.vision.image_token_id
    x[mask] = image_embeddings.to(x.dtype)
    cos, sin = mrope_cos_sin(positions, text_inverse_frequencies(cfg.head_dim, cfg.rope_theta),
                             loaded.vision.mrope_section, dtype=x.dtype)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        lw = {k[len(p):]: t for k, t in w.items() if k.startswith(p)}
        store = {}
        x = dense.attention_block(cfg, lw, x, cos, sin, lambda k, v, s=store: s.update(k=k, v=v),
                                  lambda s=store: (s["k"], s["v"]), "causal")
        x = dense.ffn_block(cfg, lw, x)
    return dense.output_head(cfg, w, x)


def test_prepare_vision_prompt_equals_the_pieces(loaded):
    images = [_image(*SIZES[0]), _image(*SIZES[2])]
    ids, grids, counts = _prompt(loaded, images)
    vp = prepare_vision_prompt(loaded.vision_weights, loaded.vision, loaded.tokenizer, _messages(2), images, "cpu")
    assert vp.ids == ids and vp.token_counts == counts and torch.equal(vp.grids, grids)
    positions, delta = mrope_positions(ids, loaded.vision.image_token_id, grids, 2)
    assert torch.equal(vp.positions, positions) and vp.delta == delta
    assert int(vp.image_mask.sum()) == vp.embeddings.shape[0] == sum(counts)
    pieces = torch.cat(encode_images(loaded.vision_weights, loaded.vision, images, "cpu"))
    assert torch.equal(vp.embeddings, pieces)


def test_prefill_and_decode_logits_equal_reference(loaded, reference):
    images = [_image(w, h) for w, h in SIZES]
    v = loaded.vision
    vp = prepare_vision_prompt(loaded.vision_weights, v, loaded.tokenizer, _messages(3), images, "cpu")
    pixel_values, _ = preprocess_images(images, v.processor)
    input_ids = torch.tensor([vp.ids])
    mm = (input_ids == v.image_token_id).int()
    with torch.no_grad():
        ref1 = reference(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=vp.grids,
                         mm_token_type_ids=mm, use_cache=True)
        nxt = int(ref1.logits[0, -1].argmax())
        ref2 = reference(input_ids=torch.tensor([[nxt]]), cache=ref1.cache, use_cache=True)

        ours = _our_logits(loaded, vp.ids, vp.embeddings, vp.positions)
        assert float((ours - ref1.logits[0]).abs().max() / ref1.logits.abs().max()) < 1e-4
        # One decode step: the generated token at sequence index len(ids), position len(ids) + delta.
        full = torch.cat([vp.positions, decode_positions(len(vp.ids), 1, vp.delta)], dim=1)
        ours2 = _our_logits(loaded, vp.ids + [nxt], vp.embeddings, full)[-1]
        assert float((ours2 - ref2.logits[0, -1]).abs().max() / ref2.logits.abs().max()) < 1e-4
