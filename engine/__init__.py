"""Slipstream's inference engine: lossless transformer inference placed per sub-layer across GPU, PCIe
streaming and CPU, re-planned live as the VRAM budget moves. Public entry point: `open_model`."""

import os

# Growable allocator segments: memory freed at a re-plan goes back to the driver whole, not stuck in
# half-used blocks (only takes effect if CUDA has not allocated yet in this process).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

# OpenMP worker threads sleep when idle instead of spinning (libgomp reads this once, when torch or
# llama.cpp first loads it, so it is set before either is imported). Spinning threads fight every other
# thread for the cores: the native matmul pool of our own (engine.kernels), a game, other processes.
# `python -m engine.bench.omp_wait --busy 2` (docs/benchmarks/omp_wait_busy*.json): the bundled model's
# CPU decode beside two busy processes 17.3 tokens/s sleeping, 0.8 spinning; 27.6 vs 31.2 on idle cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.api import Engine, open_model  # noqa: F401
