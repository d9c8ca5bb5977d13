"""Slipstream's inference engine: lossless transformer inference placed per sub-layer across GPU, PCIe
streaming and CPU, re-planned live as the VRAM budget moves. Public entry point: `open_model`."""

from engine.api import Engine, open_model  # noqa: F401
