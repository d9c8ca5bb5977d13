"""Slipstream's inference engine: lossless transformer inference placed per sub-layer across GPU, PCIe
streaming and CPU, re-planned live as the VRAM budget moves. Public entry point: `open_model`."""

import os

# Growable allocator segments: memory freed at a re-plan goes back to the driver whole, not stuck in
# half-used blocks (only takes effect if CUDA has not allocated yet in this process).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

from engine.api import Engine, open_model  # noqa: F401
