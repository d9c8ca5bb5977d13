"""The caching allocator is held to the whole-process budget less the process overhead (CUDA only: on
the GPU machine, `SLIPSTREAM_TEST_DEVICE=cuda`); elsewhere the cap is not set."""

from __future__ import annotations

import itertools
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


@pytest.mark.skipif(DEVICE != "cuda", reason="the allocator cap is a CUDA allocator setting")
def test_closing_the_accelerator_lifts_its_cap(monkeypatch):
    """The cap is process-wide: a benchmark that closes an engine and opens another (or makes weights on the
    GPU) after it must not stay under the first engine's last budget."""
    monkeypatch.setenv("SLIPSTREAM_VRAM_OVERHEAD", str(64 * MiB))
    accel = Accelerator("cuda")
    torch.cuda.empty_cache()
    try:
        accel.cap_allocator(64 * MiB + 256 * MiB)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        accel.close()
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        assert x.numel() == 512 * MiB and not accel.capped
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


def test_a_segment_moving_between_the_two_figures_is_not_counted_as_overhead(monkeypatch):
    """Another thread frees a 400 MiB segment between NVML's read and the allocator's, or reserves one
    between the allocator's read and NVML's: the overhead read stays the 500 MiB held outside."""
    from engine.sharding import device as dev

    for reserved, nvml in (([1000, 600, 600, 600], [1500, 1100]),                  # freed after NVML's read
                           ([600, 1000, 1000, 1000], [1500, 1500]),                 # reserved before it
                           ([600, 700, 700, 800, 800, 900, 900, 1000, 1000, 1100],  # moving at every read
                            [1200, 1300, 1400, 1500, 1600])):
        r, n = iter(x * MiB for x in reserved), iter(x * MiB for x in nvml)
        monkeypatch.setattr(dev.torch.cuda, "memory_reserved", lambda _d=None, r=r: next(r))
        monkeypatch.setattr(dev, "process_vram_bytes", lambda _i=0, n=n: next(n))
        assert dev._outside_allocator(torch.device("cuda", 0)) == 500 * MiB


def test_weights_of_an_8b_model_pack_into_few_pinned_chunks():
    """The Llama-3-8B shape's sub-layer buffers (embedding, head, 32 attention and 32 FFN blocks) pinned
    one block each would round up to 22 GB; packed into power-of-two chunks they cost under 1.05x."""
    from engine.sharding.device import pack_chunks

    sizes = [1_050_673_152] * 2 + [83_894_272] * 32 + [352_329_728] * 32 + [8192]
    chunk, bins = pack_chunks(sizes)
    assert chunk == 1 << 30                  # the largest buffer (the head, 1.05 GB) fits in 1 GiB
    placed = sorted((off, i) for _, items in bins for i, off in items)
    assert sorted(i for _, i in placed) == list(range(len(sizes)))
    for nbytes, items in bins:                 # within its chunk, no two buffers overlap
        spans = sorted((off, off + sizes[i]) for i, off in items)
        assert spans[-1][1] <= nbytes <= chunk
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert all(off % 256 == 0 for _, off in items)
    held = sum(n for n, _ in bins)
    assert sum(sizes) <= held < 1.05 * sum(sizes)
    one_each = sum(1 << (n - 1).bit_length() for n in sizes)
    assert one_each > 1.4 * sum(sizes)


def test_unpinned_host_buffers_are_plain_and_exact():
    from engine.sharding.device import host_buffers

    bufs = host_buffers([3 * MiB + 5, 17], pin=False)
    assert [b.numel() for b in bufs] == [3 * MiB + 5, 17] and not any(b.is_pinned() for b in bufs)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned host memory beside a CUDA GPU")
def test_pinned_host_buffers_copy_asynchronously_and_hold_little_more_than_asked():
    from engine.sharding.device import host_buffers

    before = torch.cuda.host_memory_stats()["allocated_bytes.current"]
    sizes = [96 * MiB + 4096 + 7, 40 * MiB, 40 * MiB, 3 * MiB]
    bufs = host_buffers(sizes, pin=True)
    assert [b.numel() for b in bufs] == sizes and all(b.is_pinned() for b in bufs)
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    assert held <= 256 * MiB                 # one block each would hold 128 + 64 + 64 + 4 = 260 MiB
    for i, b in enumerate(bufs):
        b.fill_(i + 1)
    outs = [b.to("cuda", non_blocking=True) for b in bufs]
    torch.cuda.synchronize()
    assert [int(o[-1]) for o in outs] == [1, 2, 3, 4] and int(outs[0].sum()) == sizes[0]


def test_slot_views_are_cut_once_and_dropped_with_their_slots():
    """A streamed sub-layer's views into its slot are reused step after step, and never outlive the slots
    (they would hold the slots' memory after a budget drop)."""
    from engine.sharding.weights import WeightStore

    accel = Accelerator("sim")
    accel.budget = 1 << 30
    ffn = {"gate.weight": torch.randn(64, 4), "up.weight": torch.randn(64, 4), "down.weight": torch.randn(4, 64)}
    store = WeightStore({"layers.0.ffn": ffn, "layers.1.ffn": {k: v + 1 for k, v in ffn.items()}}, accel)
    store.set_slots(2, store.nbytes("layers.0.ffn"))
    first = store.slot_views(0, "layers.0.ffn")
    assert store.slot_views(0, "layers.0.ffn") is first
    assert first["gate_up.weight"].data_ptr() == store.slots[0].data_ptr()
    assert store.slot_views(1, "layers.1.ffn")["down.weight"].data_ptr() != first["down.weight"].data_ptr()
    store.drop_slots()
    assert store._slot_views == {}
    store.set_slots(1, store.nbytes("layers.0.ffn"))
    again = store.slot_views(0, "layers.0.ffn")
    assert again is not first and again["gate_up.weight"].data_ptr() == store.slots[0].data_ptr()


def test_the_cap_keeps_room_for_kernels_still_to_load(monkeypatch):
    """The allocator's cap sits LAZY_KERNEL_ROOM under the budget less the overhead (CUDA loads kernels
    lazily, outside the allocator), less what the overhead has already grown by, and that room comes out
    of the bookings' margin, not out of what plans may book."""
    from engine.sharding import device as dev

    assert dev.LAZY_KERNEL_ROOM < dev.ALLOCATOR_MARGIN[0]
    monkeypatch.delenv("SLIPSTREAM_VRAM_OVERHEAD", raising=False)
    accel = object.__new__(dev.Accelerator)
    accel.kind, accel.device = "cuda", torch.device("cuda", 0)
    accel.overhead = accel.start_overhead = 800 * MiB
    total = 80 << 30
    fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": total}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: fractions.append(f))
    budget = 2 << 30
    accel.cap_allocator(budget)
    assert fractions[-1] * total == pytest.approx(budget - 800 * MiB - dev.LAZY_KERNEL_ROOM)
    accel.overhead += 40 * MiB                 # kernels seen loading: the room left shrinks by as much
    accel.cap_allocator(budget)
    assert fractions[-1] * total == pytest.approx(budget - 840 * MiB - (dev.LAZY_KERNEL_ROOM - 40 * MiB))
    accel.overhead += 200 * MiB
    accel.cap_allocator(budget)
    assert fractions[-1] * total == pytest.approx(budget - 1040 * MiB)
    assert accel.usable(budget) == budget - 1040 * MiB - dev.ALLOCATOR_MARGIN[0]
    monkeypatch.setenv("SLIPSTREAM_VRAM_OVERHEAD", str(64 * MiB))
    assert accel.lazy_room() == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="the allocator cap is a CUDA allocator setting")
def test_a_freed_segment_partly_reused_does_not_block_a_large_buffer_under_the_cap(monkeypatch):
    """With expandable segments (on by default, `device.expandable_segments`), a large buffer freed,
    a small one placed where it was and a large one asked for again fit a cap that holds both live buffers:
    with fixed segments the small buffer pins the freed segment and the new one needs a segment beside it
    (session 21, call X: a re-plan ran out this way at an unchanged budget)."""
    from engine.sharding import device

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if var in os.environ:
            pytest.skip(f"{var} is set: the allocator is the user's")
    monkeypatch.setenv("SLIPSTREAM_VRAM_OVERHEAD", str(64 * MiB))
    monkeypatch.setenv("SLIPSTREAM_EXPANDABLE_SEGMENTS", "1")
    accel = Accelerator("cuda")
    assert accel.expandable_segments and device.expandable_segments()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    try:
        accel.cap_allocator(64 * MiB + base + 320 * MiB)
        big = torch.empty(200 * MiB, dtype=torch.uint8, device="cuda")
        del big
        small = torch.empty(38 * MiB, dtype=torch.uint8, device="cuda")
        again = torch.empty(190 * MiB, dtype=torch.uint8, device="cuda")
        assert small.numel() + again.numel() == 228 * MiB
        del small, again
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
