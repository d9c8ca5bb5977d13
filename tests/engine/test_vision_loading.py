"""Qwen2.5-VL folders: config.json -> (qwen2 ModelConfig, VisionConfig), weights in both checkpoint
layouts equal transformers' state_dict, preprocessor_config.json, and one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import weight_names
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading.hf_vision import (
    is_vl_folder,
    load_hf_vl,
    load_vl_weights,
    read_vl_config,
    text_canonical_name,
    vision_canonical_name,
)
from engine.models.vision.qwen2_5_vl_tower import vision_weight_names


@pytest.fixture(scope="module")
def folder(tiny_model):
    return tiny_model("qwen2_5_vl")


@pytest.fixture(scope="module")
def reference(folder):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def _copy(folder, tmp_path):
    dst = tmp_path / "vl"
    shutil.copytree(folder, dst)
    return dst


def test_config(folder, reference):
    cfg, vcfg = read_vl_config(folder)
    rc = reference.config
    t, v = rc.text_config, rc.vision_config
    assert cfg.arch == "qwen2" and cfg.attention_bias and cfg.rope_scaling is None
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim) == (t.vocab_size, t.hidden_size, t.intermediate_size,
                                                t.num_hidden_layers, t.num_attention_heads,
                                                t.num_key_value_heads, t.hidden_size // t.num_attention_heads)
    assert cfg.rope_theta == t.rope_parameters["rope_theta"] and cfg.rms_norm_eps == t.rms_norm_eps
    assert vcfg.mrope_section == tuple(t.rope_parameters["mrope_section"])
    assert (vcfg.depth, vcfg.hidden_size, vcfg.num_heads, vcfg.intermediate_size, vcfg.out_hidden_size,
            vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size, vcfg.window_size) == (
        v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.out_hidden_size, v.patch_size,
        v.spatial_merge_size, v.temporal_patch_size, v.window_size)
    assert vcfg.fullatt_block_indexes == tuple(v.fullatt_block_indexes) == (1,)
    assert (vcfg.image_token_id, vcfg.video_token_id, vcfg.vision_start_token_id, vcfg.vision_end_token_id) == (
        rc.image_token_id, rc.video_token_id, rc.vision_start_token_id, rc.vision_end_token_id)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    assert (vcfg.processor.min_pixels, vcfg.processor.max_pixels) == (pre["min_pixels"], pre["max_pixels"])
    assert is_vl_folder(folder)


def test_weights_equal_state_dict(folder, reference):
    loaded = load_hf_vl(folder)
    cfg, vcfg = loaded.config, loaded.vision
    assert set(loaded.weights) == {n for g in weight_names(cfg).values() for n in g}
    assert set(loaded.vision_weights) == {n for g in vision_weight_names(vcfg).values() for n in g}
    for hf_name, tensor in reference.state_dict().items():
        name = vision_canonical_name(hf_name)
        if name is not None:
            ours = loaded.vision_weights[name]
            assert torch.equal(ours, tensor.reshape(ours.shape)), hf_name
            continue
        name = text_canonical_name(hf_name)
        assert name is not None, hf_name
        assert torch.equal(loaded.weights[name], tensor), hf_name
    assert loaded.tokenizer.token_to_id("<|image_pad|>") == vcfg.image_token_id


def test_transformers_5_in_memory_layout(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = _copy(folder, tmp_path)
    tensors = load_file(str(dst / "model.safetensors"))
    renamed = {}
    for k, t in tensors.items():
        if k.startswith("visual."):
            k = "model." + k
        elif k.startswith("model."):
            k = "model.language_model." + k[len("model."):]
        renamed[k] = t
    save_file(renamed, str(dst / "model.safetensors"))
    a, b = load_hf_vl(folder), load_hf_vl(dst)
    for ours, theirs in ((a.weights, b.weights), (a.vision_weights, b.vision_weights)):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_legacy_flat_config(folder, tmp_path):
    """The hub's Qwen2.5-VL / Cosmos-Reason1 config.json: text fields at the top level, rope_scaling
    {"type": "mrope"}, rope_theta at the top, in_chans, torch_dtype; processor size as a dict."""
    dst = _copy(folder, tmp_path)
    raw = json.loads((dst / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**raw, **{k: v for k, v in text.items() if k != "model_type"}, "model_type": "qwen2_5_vl",
            "rope_theta": rope["rope_theta"], "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "torch_dtype": raw.pop("dtype")}
    flat.pop("dtype", None)
    vis = flat["vision_config"]
    vis["in_chans"] = vis.pop("in_channels")
    vis.pop("rope_parameters")
    (dst / "config.json").write_text(json.dumps(flat))
    pre = json.loads((dst / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": pre.pop("min_pixels"), "longest_edge": pre.pop("max_pixels")}
    (dst / "preprocessor_config.json").write_text(json.dumps(pre))
    assert read_vl_config(dst) == read_vl_config(folder)


def _one_line(e, *words):
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_errors(folder, tmp_path, tiny_model):
    from safetensors.torch import load_file, save_file

    dst = _copy(folder, tmp_path)
    cfg, vcfg = read_vl_config(dst)
    tensors = load_file(str(dst / "model.safetensors"))
    missing = dict(tensors)
    missing.pop("visual.blocks.2.attn.qkv.bias")
    save_file(missing, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        load_vl_weights(dst, cfg, vcfg)
    _one_line(e, "missing", "vision.blocks.2.qkv.bias")

    extra = {**tensors, "visual.blocks.9.attn.qkv.bias": tensors["visual.blocks.2.attn.qkv.bias"].clone()}
    save_file(extra, str(dst / "model.safetensors"))
    with pytest.raises(UnsupportedModelError) as e:
        load_vl_weights(dst, cfg, vcfg)
    _one_line(e, "visual.blocks.9.attn.qkv.bias")

    bad = {**tensors, "visual.merger.mlp.2.weight": tensors["visual.merger.mlp.2.weight"][:, :-1].contiguous()}
    save_file(bad, str(dst / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        load_vl_weights(dst, cfg, vcfg)
    _one_line(e, "vision.merger.fc2.weight", "shape")

    raw = json.loads((dst / "config.json").read_text())
    raw["text_config"]["rope_parameters"]["mrope_section"] = [2, 2, 2]
    (dst / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError) as e:
        read_vl_config(dst)
    _one_line(e, "mrope_section")

    plain = tiny_model("qwen2")
    assert not is_vl_folder(plain)
    with pytest.raises(UnsupportedModelError) as e:
        read_vl_config(plain)
    _one_line(e, "qwen2")
