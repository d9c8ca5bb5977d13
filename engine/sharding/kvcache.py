"""The paged KV cache: fixed-size blocks, a block table per sequence, each layer's blocks where its
attention runs.

Logical block ids are shared by all layers (one block table per sequence); every layer keeps its keys
and values in a pool indexed by those ids, on the GPU (booked under "kv") or in host memory. Re-planning
moves a layer's blocks between the two one by one; a sequence grows block by block and can be cut back
to a prefix (a new chat turn keeps the conversation's blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ModelConfig
from engine.sharding.device import Accelerator

BLOCK_SIZE = 16


@dataclass
class Sequence:
    """One sequence's tokens in the cache."""

    block_table: list[int] = field(default_factory=list)
    length: int = 0                 # tokens whose K/V are stored
    token_ids: list[int] = field(default_factory=list)


class LayerPool:
    """Keys and values of one layer: [capacity_blocks, BLOCK_SIZE, kv_heads, head_dim] each."""

    def __init__(self, shape_tail: tuple[int, int], dtype: torch.dtype):
        self.tail = shape_tail
        self.dtype = dtype
        self.on_gpu = False
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def block_bytes(self) -> int:
        return 2 * BLOCK_SIZE * self.tail[0] * self.tail[1] * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[0]


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, accel: Accelerator | None):
        self.cfg = cfg
        self.accel = accel
        self.dtype = dtype
        self.pools = [LayerPool((cfg.num_kv_heads, cfg.head_dim), dtype) for _ in range(cfg.num_layers)]
        self.free_blocks: list[int] = []
        self.n_blocks = 0           # logical blocks handed out so far (capacity of every pool)
        self.block_bytes = self.pools[0].block_bytes() if self.pools else 0

    # ---- block allocation ----------------------------------------------------------------------
    def _grow(self, n_blocks: int) -> None:
        """Make every pool hold `n_blocks` logical blocks."""
        for i, pool in enumerate(self.pools):
            self._resize(i, pool, n_blocks, pool.on_gpu)
        self.free_blocks.extend(range(self.n_blocks, n_blocks))
        self.n_blocks = n_blocks

    def _resize(self, layer: int, pool: LayerPool, n_blocks: int, on_gpu: bool) -> None:
        """Reallocate one layer's pool with `n_blocks` blocks on the GPU or host, keeping its contents.
        The booking changes by the difference only, so a pool that grows in place never double-books."""
        old_k, old_v = pool.k, pool.v
        keep = min(pool.capacity, n_blocks)
        device = self.accel.device if on_gpu else torch.device("cpu")
        shape = (n_blocks, BLOCK_SIZE) + pool.tail
        new_bytes = n_blocks * pool.block_bytes() if on_gpu else 0
        old_bytes = pool.capacity * pool.block_bytes() if pool.on_gpu else 0
        if new_bytes > old_bytes:
            self.accel.book(new_bytes - old_bytes, "kv", f"KV cache of layer {layer}")
        try:
            k = torch.empty(shape, dtype=self.dtype, device=device)
            v = torch.empty(shape, dtype=self.dtype, device=device)
        except torch.OutOfMemoryError:
            if new_bytes > old_bytes:
                self.accel.unbook(new_bytes - old_bytes, "kv")
            raise
        for b in range(keep):  # block by block, so a move never needs a second whole copy in flight
            k[b].copy_(old_k[b])
            v[b].copy_(old_v[b])
        pool.k, pool.v, pool.on_gpu = k, v, on_gpu
        if old_bytes > new_bytes:
            self.accel.unbook(old_bytes - new_bytes, "kv")

    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Give `seq` blocks for `n_new` more tokens."""
        need = -(-(seq.length + n_new) // BLOCK_SIZE) - len(seq.block_table)
        if need <= 0:
            return
        if len(self.free_blocks) < need:
            self._grow(self.n_blocks + need - len(self.free_blocks))
        # Lowest ids first keeps a lone sequence's blocks contiguous (reads then need no gather).
        self.free_blocks.sort()
        seq.block_table.extend(self.free_blocks[:need])
        del self.free_blocks[:need]

    def truncate(self, seq: Sequence, length: int) -> None:
        """Keep the first `length` tokens of `seq`, free the blocks past them."""
        length = min(length, seq.length)
        keep = -(-length // BLOCK_SIZE)
        self.free_blocks.extend(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.length = length
        del seq.token_ids[length:]

    def release(self, seq: Sequence) -> None:
        self.truncate(seq, 0)

    # ---- placement -----------------------------------------------------------------------------
    def place_layer(self, layer: int, on_gpu: bool) -> None:
        pool = self.pools[layer]
        if pool.on_gpu != on_gpu:
            self._resize(layer, pool, pool.capacity, on_gpu)
            pool.on_gpu = on_gpu

    def gpu_bytes(self) -> int:
        return sum(p.capacity * p.block_bytes() for p in self.pools if p.on_gpu)

    def shrink_to_fit(self, seqs: list[Sequence]) -> None:
        """Drop free blocks at the end of the pools (after sequences were released)."""
        used = max((max(s.block_table) + 1 for s in seqs if s.block_table), default=0)
        if used < self.n_blocks:
            for i, pool in enumerate(self.pools):
                self._resize(i, pool, used, pool.on_gpu)
            self.free_blocks = [b for b in self.free_blocks if b < used]
            self.n_blocks = used

    # ---- reads and writes ----------------------------------------------------------------------
    def write(self, layer: int, seq: Sequence, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] for positions start..start+n-1."""
        pool = self.pools[layer]
        n = k.shape[1]
        pos = torch.arange(start, start + n)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        flat = (table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(pool.k.device)
        pool.k.view(-1, *pool.tail).index_copy_(0, flat, k.transpose(0, 1).to(self.dtype))
        pool.v.view(-1, *pool.tail).index_copy_(0, flat, v.transpose(0, 1).to(self.dtype))

    def read(self, layer: int, seq: Sequence, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions: [kv_heads, length, head_dim] each."""
        pool = self.pools[layer]
        nb = -(-length // BLOCK_SIZE)
        blocks = seq.block_table[:nb]
        if blocks == list(range(blocks[0], blocks[0] + nb)):
            k = pool.k[blocks[0]:blocks[0] + nb]
            v = pool.v[blocks[0]:blocks[0] + nb]
        else:
            idx = torch.tensor(blocks, dtype=torch.long, device=pool.k.device)
            k, v = pool.k.index_select(0, idx), pool.v.index_select(0, idx)
        k = k.reshape(-1, *pool.tail)[:length].transpose(0, 1)
        v = v.reshape(-1, *pool.tail)[:length].transpose(0, 1)
        return k, v

    def close(self) -> None:
        for i, pool in enumerate(self.pools):
            if pool.on_gpu and pool.k is not None:
                self.accel.unbook(pool.capacity * pool.block_bytes(), "kv")
            pool.k = pool.v = None
            pool.on_gpu = False
        self.free_blocks, self.n_blocks = [], 0
