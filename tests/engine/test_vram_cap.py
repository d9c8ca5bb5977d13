"""The caching allocator is held to the whole-process budget less the process overhead (CUDA only: on
the GPU machine, `SLIPSTREAM_TEST_DEVICE=cuda`); elsewhere the cap is not set."""

from __future__ import annotations

import os

import pytest
import torch

from engine.sharding.device import Accelerator

DEVICE = os.environ.get("SLIPSTREAM_TEST_DEVICE", "sim")
MiB = 1 << 20


def test_sim_sets_no_cap():
    assert Accelerator("sim").cap_allocator(1 << 30) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="the allocator cap is a CUDA allocator setting")
def test_allocator_cannot_grow_past_the_budget(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_VRAM_OVERHEAD", str(64 * MiB))
    accel = Accelerator("cuda")
    torch.cuda.empty_cache()
    try:
        assert accel.cap_allocator(64 * MiB + 256 * MiB) is not None
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        accel.cap_allocator(64 * MiB + 2048 * MiB)        # a raised budget lifts it
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        assert x.numel() == 512 * MiB
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


@pytest.mark.skipif(DEVICE != "cuda", reason="NVML's per-process figure on the GPU machine")
def test_overhead_follows_what_nvml_shows_beyond_the_allocator(monkeypatch):
    """Kernels load lazily and take device memory outside the allocator: a budget change re-reads it."""
    from engine.sharding.device import process_vram_bytes

    monkeypatch.delenv("SLIPSTREAM_VRAM_OVERHEAD", raising=False)
    accel = Accelerator("cuda")
    accel.overhead = 0
    accel.refresh_overhead()
    nvml = process_vram_bytes(0)
    if nvml is None:
        pytest.skip("no per-process NVML figure here")
    assert accel.overhead > 0
    assert abs(accel.overhead - (nvml - torch.cuda.memory_reserved())) < 64 * MiB
    high = accel.overhead + (1 << 30)
    accel.overhead = high
    accel.refresh_overhead()
    assert accel.overhead == high            # never lowered


def test_unpinned_page_locked_buffer_is_plain_memory():
    from engine.sharding.device import page_locked, page_locked_bytes

    before = page_locked_bytes()
    buf = page_locked(3 * MiB + 5, pin=False)
    assert buf.numel() == 3 * MiB + 5 and buf.dtype == torch.uint8
    assert page_locked_bytes() == before


@pytest.mark.skipif(DEVICE != "cuda", reason="registering host memory with the CUDA driver")
def test_page_locked_buffers_cost_their_own_size_and_copy_asynchronously():
    import gc

    from engine.sharding.device import page_locked, page_locked_bytes

    before = page_locked_bytes()
    n = 96 * MiB + 4096 + 7                    # PyTorch's pinned allocator would hold 128 MiB for it
    buf = page_locked(n)
    assert buf.is_pinned() and buf.numel() == n
    assert page_locked_bytes() == before + n
    buf.fill_(3)
    out = buf.to("cuda", non_blocking=True)
    back = page_locked(n)
    back.copy_(out, non_blocking=True)
    torch.cuda.synchronize()
    assert int(back[n - 1]) == 3 and int(back.sum()) == 3 * n
    del buf, back, out
    gc.collect()
    assert page_locked_bytes() == before
