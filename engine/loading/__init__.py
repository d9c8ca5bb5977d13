"""Model loading: GGUF files and Hugging Face folders -> `LoadedModel` (config, weights, tokenizer).

`load_model(source)` reads everything; `read_config(source)` only the configuration (no weights). A
source is None (the bundled default model), a `.gguf` file or a Hugging Face model folder. Every bad
input raises `ModelLoadError` / `UnsupportedModelError` with one line naming the file or field.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import ModelConfig
from engine.loading.loaded import LoadedModel, Tokenizer
from engine.loading.source import resolve_source

__all__ = ["LoadedModel", "Tokenizer", "load_model", "load_tokenizer", "read_config", "resolve_source"]


def read_config(source: str | Path | None) -> ModelConfig:
    """The model's configuration, read without touching its weights. A named shape such as
    "llama3-8b" (engine.bench.shapes) is accepted where no file or folder of that name exists."""
    if isinstance(source, str) and not Path(source).exists():
        from engine.bench.shapes import SHAPES

        if source.lower() in SHAPES:
            return SHAPES[source.lower()]
    path = resolve_source(source)
    if path.is_dir():
        from engine.loading.hf import read_hf_config

        return read_hf_config(path)
    from engine.loading.gguf_file import GgufFile

    return GgufFile(path).config


def load_tokenizer(source: str | Path | None) -> Tokenizer:
    """Only the tokenizer (and chat template) of a model."""
    path = resolve_source(source)
    if path.is_dir():
        from engine.loading.hf import load_hf_tokenizer, read_hf_config

        return load_hf_tokenizer(path, read_hf_config(path))
    from engine.loading.gguf_file import GgufFile

    return GgufFile(path).tokenizer()


def load_model(source: str | Path | None) -> LoadedModel:
    """Config, weights (canonical names, CPU, precision as stored) and tokenizer of a model."""
    path = resolve_source(source)
    if path.is_dir():
        from engine.loading.hf import load_hf_tokenizer, load_hf_weights, read_hf_config

        cfg = read_hf_config(path)
        weights = load_hf_weights(path, cfg)
        return LoadedModel(config=cfg, weights=weights, tokenizer=load_hf_tokenizer(path, cfg),
                           source=str(path), fmt="hf", file_type=_dtype_tag(cfg.dtype))
    from engine.loading.gguf_file import GgufFile

    gguf = GgufFile(path)
    return LoadedModel(config=gguf.config, weights=gguf.weights(), tokenizer=gguf.tokenizer(),
                       source=str(path), fmt="gguf", file_type=gguf.file_type)


def _dtype_tag(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)
