"""Which file or folder a model source names, checked before anything heavy is read."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelLoadError

_QUANT_FREE = {"F32", "F16", "BF16"}


def resolve_source(source) -> Path:
    """None -> the bundled default GGUF; otherwise an existing GGUF file or Hugging Face folder."""
    if source is None:
        from engine.loading.bundled import bundled_model_path

        return bundled_model_path()
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: not a Hugging Face model folder (no config.json)")
        return path
    if path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"{path}: not a model (expected a .gguf file or a Hugging Face folder)")
    return path


def gguf_is_quantized(path: Path) -> bool:
    """True when any weight of the GGUF file is stored in a quantized type (not F32/F16/BF16)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path), "r")
        return any(t.tensor_type.name not in _QUANT_FREE for t in reader.tensors)
    except Exception as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc.__class__.__name__}: {exc})") from exc
