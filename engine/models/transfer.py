"""Activations moved between host and GPU in one copy, through pinned host memory.

A step moves activations across PCIe at every change of side: the hidden state into and out of a
sub-layer placed on the other side, a MoE layer's state (three hidden-sized tensors and its routing) into
and out of an expert group. From pageable memory the driver copies through a staging buffer of its own and
the host waits for the whole transfer; a 6.3 MB MoE state took 1.15 ms a move that way on the H200 (5.5
GB/s; session 12, call ZZ), where the link carries pinned copies at about 55 GB/s. Here the parts are
packed back to back into one pinned buffer (from PyTorch's caching host allocator, so after the first
steps a move allocates nothing new) and copied on the current stream: host to GPU without waiting for the
copy, GPU to host followed by one wait that covers the GPU's queue and the copy together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Larger moves (a long prompt's float32 logits: 1024 rows of a 152k vocabulary are 622 MB) go through
# pageable memory: the caching host allocator keeps every pinned block it hands out, rounded up to a power
# of two, for the life of the process.
MAX_PINNED_BYTES = 64 << 20


def packed_move(tensors: list[torch.Tensor], device, wait: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """`[t.to(device) for t in tensors]` in one copy: their bytes packed back to back, the widest elements
    first so that every view of the buffer stays aligned (each part's size is a multiple of its own element
    size). Between the CPU and a CUDA GPU the host side of the copy is pinned (up to MAX_PINNED_BYTES).
    To the host, `wait()` (default: the current stream's `synchronize`) is called after the copy is queued
    and must wait for everything queued on the current stream so far."""
    device = torch.device(device)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    flat = [tensors[i].reshape(-1).view(torch.uint8) for i in order]
    total = sum(f.numel() for f in flat)
    src = tensors[0].device
    pinned = total <= MAX_PINNED_BYTES       # (the branches below need CUDA on one side: it is there)
    if pinned and device.type == "cuda" and src.type == "cpu":
        staged = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        torch.cat(flat, out=staged)
        buf = staged.to(device, non_blocking=True)     # (the allocator keeps `staged` until the copy is done)
    elif pinned and device.type == "cpu" and src.type == "cuda":
        packed = flat[0] if len(flat) == 1 else torch.cat(flat)
        buf = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        buf.copy_(packed, non_blocking=True)
        if wait is None:
            torch.cuda.current_stream(src).synchronize()
        else:
            wait()
    else:
        buf = flat[0].to(device, copy=True) if len(flat) == 1 else torch.cat(flat).to(device)
    out: list[torch.Tensor] = [None] * len(tensors)   # type: ignore[list-item]
    at = 0
    for i, f in zip(order, flat):
        t, nb = tensors[i], f.numel()
        out[i] = buf[at:at + nb].view(t.dtype).view(t.shape)
        at += nb
    return out
