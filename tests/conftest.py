"""Test-wide settings: offline Hugging Face, offscreen Qt, and the tiny model folder fixture."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# Tests size VRAM budgets in bytes of their tiny models: on CUDA the process's own overhead (context,
# workspaces) is not charged to them. The engine's default charges it (see engine.sharding.device).
os.environ.setdefault("SLIPSTREAM_VRAM_OVERHEAD", "0")
# As the engine sets it (engine/__init__.py), before anything here loads torch's OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest


@pytest.fixture(scope="session")
def tiny_model():
    """Factory: tiny_model("llama3", tie_word_embeddings=True) -> Path of a cached tiny HF folder."""
    from tests.tiny_models import tiny_model_cache

    return tiny_model_cache
