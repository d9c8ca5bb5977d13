"""GGUF files: round trip of tiny HF models through a converter-style GGUF (Q/K un-permute, dtypes,
quantized types, llama3 rope factors) and the tokenizer rebuilt from GGUF metadata."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.loading import load_model, load_tokenizer, read_config
from engine.loading.gguf_file import GgufFile, permute_rope_rows, unpermute_rope_rows
from engine.loading.rope_factors import llama3_factors, llama3_scaling_from_factors
from tests.tiny_models import make_tiny_gguf

TEXTS = [
    "Hello world",
    " Hello  world!\n\n",
    "The year 2024 has 365 days; π≈3.14159.",
    "ünïcödé façade — naïve café 日本語 🎉",
    "def f(x):\n\treturn x**2  # comment\n",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll've DONE it",
    "   leading and trailing   ",
]


@pytest.fixture(scope="module")
def gguf_of(tiny_model, tmp_path_factory):
    made: dict = {}

    def make(arch: str, qtype: str = "F32", **options):
        key = (arch, qtype, tuple(sorted(options.items())))
        if key not in made:
            hf = tiny_model(arch, **options)
            made[key] = (hf, make_tiny_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{arch}-{qtype}.gguf", qtype))
        return made[key]

    return make


def test_unpermute_inverts_the_converter_permutation():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(w, 4), 4), w)
    assert not torch.equal(permute_rope_rows(w, 4), w)
    b = torch.randn(2 * 16)
    assert torch.equal(unpermute_rope_rows(permute_rope_rows(b, 2), 2), b)


@pytest.mark.parametrize(("arch", "options"), [
    ("llama", {}), ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    ("llama3", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", {})])
def test_f32_round_trip_equals_hf_weights(gguf_of, arch, options):
    hf, gguf = gguf_of(arch, **options)
    from_gguf, from_hf = load_model(gguf), load_model(hf)
    assert from_gguf.fmt == "gguf" and from_gguf.file_type == "F32"
    assert from_gguf.weights.keys() == from_hf.weights.keys()
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    a, b = from_gguf.config, from_hf.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "qk_norm", "dtype", "bos_token_id"):
        assert getattr(a, field) == getattr(b, field), field
    assert a.arch == ("llama" if arch in ("llama3", "mistral") else b.arch)
    assert set(a.eos_token_ids) == set(b.eos_token_ids)   # eos + <|im_end|> (end of turn)


def test_llama3_rope_factors_round_trip(gguf_of):
    hf, gguf = gguf_of("llama3")
    a, b = read_config(gguf), read_config(hf)
    assert a.rope_scaling_dict["rope_type"] == "llama3"
    assert torch.allclose(llama3_factors(a.rope_scaling_dict, 16, a.rope_theta),
                          llama3_factors(b.rope_scaling_dict, 16, b.rope_theta))


def test_llama3_scaling_recovered_exactly_for_llama31_shapes():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert llama3_scaling_from_factors(llama3_factors(scaling, 128, 500000.0), 128, 500000.0) == scaling
    assert llama3_scaling_from_factors(torch.ones(64), 128, 500000.0) == {}
    assert llama3_scaling_from_factors(torch.linspace(1, 3, 64) ** 2, 128, 500000.0) is None


@pytest.mark.parametrize(("qtype", "dtype", "tol"), [
    ("F16", torch.float16, 0), ("BF16", torch.bfloat16, 0), ("Q8_0", torch.float32, 0.02),
    ("Q4_0", torch.float32, 0.2), ("Q4_1", torch.float32, 0.2), ("Q5_0", torch.float32, 0.1)])
def test_typed_round_trip(gguf_of, qtype, dtype, tol):
    hf, gguf = gguf_of("llama", qtype)
    loaded, reference = load_model(gguf), load_model(hf)
    assert loaded.file_type == qtype
    assert loaded.config.dtype == {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype, "float32")
    for name, ref in reference.weights.items():
        got = loaded.weights[name]
        if ref.ndim == 1:
            assert got.dtype == torch.float32 and torch.equal(got, ref), name   # norms stay F32
            continue
        assert got.dtype == dtype, name
        if tol == 0:
            assert torch.equal(got, ref.to(dtype)), name
        else:
            assert (got - ref).abs().max() <= tol * ref.abs().max(), name


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_1"])
def test_quantized_tensors_dequantize_like_gguf(tmp_path, qtype):
    """Random quantized blocks (gguf cannot quantize K types): the loader's float32 equals gguf's."""
    import gguf

    q = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[q]
    rows, cols = 4, 256
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)
    # keep the f16 scales finite: overwrite every byte pair's high byte into a small range
    raw[:, 1::2] &= 0x3B
    path = tmp_path / f"{qtype}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    tensor = reader.tensors[0]
    expected = gguf.quants.dequantize(tensor.data, q)
    f = GgufFile.__new__(GgufFile)
    f.path = path
    got = f._tensor(tensor)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, cols)
    np.testing.assert_array_equal(got.numpy(), expected.reshape(rows, cols))


@pytest.mark.parametrize("arch", ["llama", "llama3", "mistral", "qwen2", "qwen3"])
def test_gguf_tokenizer_matches_hf_tokenizer(gguf_of, arch):
    hf, gguf = gguf_of(arch)
    a, b = load_tokenizer(gguf), load_tokenizer(hf)
    assert (a.bos_token_id, a.add_bos) == (b.bos_token_id, b.add_bos)
    assert a.eos_token_ids == b.eos_token_ids
    for text in TEXTS:
        assert a.encode(text) == b.encode(text), text
        assert a.encode(text, add_special_tokens=True) == b.encode(text, add_special_tokens=True), text
        ids = b.encode(text)
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert a.apply_chat_template(messages) == b.apply_chat_template(messages)


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2"])
def test_gguf_tokenizer_matches_llama_cpp(gguf_of, arch):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    _, gguf = gguf_of(arch)
    reference = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    ours = load_tokenizer(gguf)
    for text in TEXTS:
        expected = reference.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.encode(text, add_special_tokens=True) == expected, text
