"""Hugging Face folders: config translation and weights equal to transformers' state_dict."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import weight_names
from engine.loading import load_model, read_config
from engine.loading.hf import canonical_name

VARIANTS = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),   # tied head, MHA
    ("llama3", {}),
    ("mistral", {}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"num_hidden_layers": 3}),
]


def _hf_state_dict(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return model.state_dict()


@pytest.mark.parametrize(("arch", "options"), VARIANTS)
def test_weights_equal_transformers_state_dict(tiny_model, arch, options):
    path = tiny_model(arch, **options)
    loaded = load_model(path)
    cfg = loaded.config
    expected_names = {n for group in weight_names(cfg).values() for n in group}
    assert set(loaded.weights) == expected_names
    reference = _hf_state_dict(path)
    for hf_name, tensor in reference.items():
        name = canonical_name(hf_name)
        if name == "head.weight" and cfg.tie_word_embeddings:
            assert torch.equal(tensor, loaded.weights["embed.weight"])
            continue
        assert name is not None, hf_name
        assert loaded.weights[name].dtype == tensor.dtype
        assert torch.equal(loaded.weights[name], tensor), hf_name
    assert loaded.fmt == "hf" and loaded.file_type == "f32"
    assert ("head.weight" in loaded.weights) == (not cfg.tie_word_embeddings)


@pytest.mark.parametrize(("arch", "options"), VARIANTS)
def test_config_matches_transformers_config(tiny_model, arch, options):
    from transformers import AutoConfig

    path = tiny_model(arch, **options)
    cfg = read_config(path)
    hf = AutoConfig.from_pretrained(path)
    assert cfg.arch == hf.model_type
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.max_position_embeddings == 256
    assert cfg.dtype == "float32"
    assert set(cfg.eos_token_ids) == {hf.eos_token_id, json.loads(
        (path / "generation_config.json").read_text())["eos_token_id"][1]}
    if arch == "llama3":
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling_dict == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    else:
        assert cfg.rope_scaling is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_is_kept(tiny_model, dtype):
    path = tiny_model("llama3", dtype=dtype)
    loaded = load_model(path)
    assert loaded.config.dtype == dtype
    assert loaded.file_type == {"bfloat16": "bf16", "float16": "f16"}[dtype]
    assert {t.dtype for t in loaded.weights.values()} == {getattr(torch, dtype)}
    reference = _hf_state_dict(path)
    assert torch.equal(loaded.weights["layers.1.down.weight"], reference["model.layers.1.mlp.down_proj.weight"])


def test_sharded_checkpoint(tiny_model):
    path = tiny_model("qwen3", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    loaded = load_model(path)
    reference = _hf_state_dict(path)
    for hf_name, tensor in reference.items():
        assert torch.equal(loaded.weights[canonical_name(hf_name)], tensor)


def test_legacy_config_keys(tiny_model, tmp_path):
    """transformers 4.x wrote rope_theta/rope_scaling/torch_dtype at the top level."""
    import shutil

    folder = tmp_path / "legacy"
    shutil.copytree(tiny_model("llama3"), folder)
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items()}
    raw["torch_dtype"] = raw.pop("dtype")
    raw.pop("head_dim")
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = read_config(folder)
    assert cfg.rope_theta == 500000.0 and cfg.head_dim == 16
    assert cfg.rope_scaling_dict["rope_type"] == "llama3"
    assert cfg.dtype == "float32"


def test_canonical_names():
    assert canonical_name("model.layers.12.self_attn.q_proj.weight") == "layers.12.q.weight"
    assert canonical_name("model.layers.0.self_attn.k_norm.weight") == "layers.0.k_norm.weight"
    assert canonical_name("model.layers.3.post_attention_layernorm.weight") == "layers.3.ffn_norm.weight"
    assert canonical_name("model.embed_tokens.weight") == "embed.weight"
    assert canonical_name("lm_head.weight") == "head.weight"
    assert canonical_name("model.layers.0.mlp.experts.0.w1.weight") is None


def test_read_config_accepts_named_shapes():
    cfg = read_config("llama3-8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.dtype) == (32, 4096, "bfloat16")
