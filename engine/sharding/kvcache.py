"""The paged KV cache: fixed-size blocks, a block table per sequence, each layer's blocks where its
attention runs.

Logical block ids are shared by all layers (one block table per sequence); every layer keeps its keys
and values in a pool indexed by those ids, on the GPU (booked under "kv") or in host memory. Re-planning
moves a layer's blocks between the two one by one; a sequence grows block by block and can be cut back.

Prefix caching: a full block is known by the hash of (its parent block's hash, its tokens). A sequence
that is released leaves its full blocks cached (reference count 0, least recently used first out); a new
sequence whose tokens start the same way takes those blocks instead of recomputing them, so a new chat
turn, or a return to an older conversation, only computes what is new.
"""

from __future__ import annotations

import math
from collections import OrderedDict
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
    rope_delta: int = 0             # rotary position = cache index + delta (M-RoPE after images)
    cacheable: bool = True          # False where token ids do not determine the KV (image embeddings)


def block_hashes(token_ids: list[int]) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    out, parent = [], 0
    for i in range(len(token_ids) // BLOCK_SIZE):
        parent = hash((parent, tuple(token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
        out.append(parent)
    return out


FP8_MAX = 448.0                  # largest finite float8 e4m3 value


class LayerPool:
    """Keys and values of one layer: [capacity_blocks, BLOCK_SIZE, kv_heads, head_dim] each.

    With `fp8`, keys and values are stored as float8 e4m3 (kept in uint8 tensors) with one float32
    scale per token and head ([capacity_blocks, BLOCK_SIZE, kv_heads] each), about half the bytes of a
    16-bit cache.
    """

    def __init__(self, shape_tail: tuple[int, int], dtype: torch.dtype, fp8: bool = False):
        self.tail = shape_tail
        self.dtype = dtype
        self.fp8 = fp8
        self.on_gpu = False
        self.parts: list[torch.Tensor] | None = None     # k, v (, k scales, v scales)

    def part_specs(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape of one block, dtype) of every stored tensor."""
        if not self.fp8:
            return [((BLOCK_SIZE, *self.tail), self.dtype)] * 2
        return [((BLOCK_SIZE, *self.tail), torch.uint8)] * 2 + [((BLOCK_SIZE, self.tail[0]), torch.float32)] * 2

    def block_bytes(self) -> int:
        return sum(math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in self.part_specs())

    @property
    def k(self) -> torch.Tensor | None:
        return None if self.parts is None else self.parts[0]

    @property
    def capacity(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[0]


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, accel: Accelerator | None, fp8: bool = False):
        self.cfg = cfg
        self.accel = accel
        self.dtype = dtype
        self.fp8 = fp8
        self.pools = [LayerPool((cfg.num_kv_heads, cfg.head_dim), dtype, fp8) for _ in range(cfg.num_layers)]
        self.free_blocks: list[int] = []
        self.n_blocks = 0           # logical blocks handed out so far (capacity of every pool)
        self.refs: dict[int, int] = {}                      # block -> sequences using it
        self.hash_of: dict[int, int] = {}                   # cached full block -> its chain hash
        self.block_of: dict[int, int] = {}                  # chain hash -> cached block
        self.evictable: OrderedDict[int, None] = OrderedDict()   # cached, unused; oldest first
        self.prefix_stats = {"lookups": 0, "prompt_tokens": 0, "hit_tokens": 0}
        self._index_memo: dict[tuple, torch.Tensor] = {}   # pool-row and block indexes of recent steps
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
        old_parts = pool.parts
        keep = min(pool.capacity, n_blocks)
        device = self.accel.device if on_gpu else torch.device("cpu")
        new_bytes = n_blocks * pool.block_bytes() if on_gpu else 0
        old_bytes = pool.capacity * pool.block_bytes() if pool.on_gpu else 0
        if new_bytes > old_bytes:
            self.accel.book(new_bytes - old_bytes, "kv", f"KV cache of layer {layer}")
        try:
            parts = [torch.empty((n_blocks, *shape), dtype=dt, device=device) for shape, dt in pool.part_specs()]
        except torch.OutOfMemoryError:
            if new_bytes > old_bytes:
                self.accel.unbook(new_bytes - old_bytes, "kv")
            raise
        for b in range(keep):  # block by block, so a move never needs a second whole copy in flight
            for new_part, old_part in zip(parts, old_parts):
                new_part[b].copy_(old_part[b])
        pool.parts, pool.on_gpu = parts, on_gpu
        if old_bytes > new_bytes:
            self.accel.unbook(old_bytes - new_bytes, "kv")

    def _take_block(self) -> int:
        if not self.free_blocks and not self.evictable:
            self._grow(self.n_blocks + 1)
        if self.free_blocks:
            self.free_blocks.sort()       # lowest ids first keeps a lone sequence's blocks contiguous
            return self.free_blocks.pop(0)
        block, _ = self.evictable.popitem(last=False)      # least recently used cached block
        del self.block_of[self.hash_of.pop(block)]
        return block

    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Give `seq` blocks for `n_new` more tokens."""
        need = -(-(seq.length + n_new) // BLOCK_SIZE) - len(seq.block_table)
        if need <= 0:
            return
        spare = len(self.free_blocks) + len(self.evictable)
        if spare < need:
            self._grow(self.n_blocks + need - spare)
        for _ in range(need):
            block = self._take_block()
            self.refs[block] = 1
            seq.block_table.append(block)

    def match_prefix(self, seq: Sequence, token_ids: list[int]) -> int:
        """Start an empty `seq` with the cached blocks of the longest cached prefix of `token_ids` (at
        least one token is always left to compute). Returns the number of tokens reused."""
        assert not seq.block_table
        usable = (len(token_ids) - 1) // BLOCK_SIZE
        for h in block_hashes(token_ids[:usable * BLOCK_SIZE]):
            block = self.block_of.get(h)
            if block is None:
                break
            self.evictable.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
            seq.block_table.append(block)
        seq.length = len(seq.block_table) * BLOCK_SIZE
        seq.token_ids = list(token_ids[:seq.length])
        self.prefix_stats["lookups"] += 1
        self.prefix_stats["prompt_tokens"] += len(token_ids)
        self.prefix_stats["hit_tokens"] += seq.length
        return seq.length

    def _drop(self, block: int, h: int | None) -> None:
        """One sequence stops using `block`; full blocks with a hash stay cached."""
        self.refs[block] -= 1
        if self.refs[block] > 0:
            return
        del self.refs[block]
        if h is not None and block not in self.hash_of and h not in self.block_of:
            self.hash_of[block], self.block_of[h] = h, block
        if block in self.hash_of:
            self.evictable[block] = None
            self.evictable.move_to_end(block)
        else:
            self.free_blocks.append(block)

    def truncate(self, seq: Sequence, length: int) -> None:
        """Keep the first `length` tokens of `seq`; blocks past them leave the sequence (full ones stay
        cached for a later sequence that starts the same way)."""
        length = min(length, seq.length)
        keep = -(-length // BLOCK_SIZE)
        hashes = block_hashes(seq.token_ids[:seq.length]) if seq.cacheable else []
        for i in range(len(seq.block_table) - 1, keep - 1, -1):
            self._drop(seq.block_table[i], hashes[i] if i < len(hashes) else None)
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

    def forget_cached(self) -> None:
        """Drop every cached (unused) block: they become free blocks."""
        for block in list(self.evictable):
            del self.block_of[self.hash_of.pop(block)]
            self.free_blocks.append(block)
        self.evictable.clear()

    # ---- reads and writes ----------------------------------------------------------------------
    def write(self, layer: int, seq: Sequence, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] for positions start..start+n-1."""
        self.write_many(layer, [(seq, start, k.shape[1])], k, v)

    def write_many(self, layer: int, segments: list[tuple[Sequence, int, int]], k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """The new keys and values of several sequences at once (a batched step): k, v [kv_heads, N,
        head_dim] hold the tokens of each segment (sequence, start, n) one after another."""
        pool = self.pools[layer]
        flat = self._slot_index(segments, pool.k.device)
        values = [k.transpose(0, 1), v.transpose(0, 1)]              # [n, kv_heads, head_dim]
        if pool.fp8:
            scales = [t.abs().amax(-1).float().clamp(min=1e-12) / FP8_MAX for t in values]
            values = [(t.float() / sc[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
                      for t, sc in zip(values, scales)] + scales
        for part, value in zip(pool.parts, values):
            part.view(-1, *part.shape[2:]).index_copy_(0, flat, value.to(part.dtype))

    def _slot_index(self, segments: list[tuple[Sequence, int, int]], device: torch.device) -> torch.Tensor:
        """Flat pool rows of positions start..start+n-1 of each segment, computed once per step and device
        (every layer of a step writes the same rows)."""
        key = ("rows", device, *((start, n, tuple(seq.block_table[start // BLOCK_SIZE:
                                                                  (start + n - 1) // BLOCK_SIZE + 1]))
                                 for seq, start, n in segments))
        flat = self._index_memo.get(key)
        if flat is None:
            rows = []
            for start, n, blocks in key[2:]:
                pos = torch.arange(start, start + n)
                table = torch.tensor(blocks, dtype=torch.long)
                rows.append(table[pos // BLOCK_SIZE - start // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            flat = self._memo_index(key, torch.cat(rows) if len(rows) > 1 else rows[0], device)
        return flat

    def _memo_index(self, key: tuple, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Keep an index tensor (moved to `device` once: a copy to the GPU waits for its queue) for the
        other layers of the step; the memo holds the last few steps' indexes of a batch."""
        if len(self._index_memo) >= 1024:
            self._index_memo.clear()
        index = self._index_memo[key] = index.to(device)
        return index

    def read(self, layer: int, seq: Sequence, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions: [kv_heads, length, head_dim] each."""
        pool = self.pools[layer]
        nb = -(-length // BLOCK_SIZE)
        blocks = seq.block_table[:nb]
        if blocks == list(range(blocks[0], blocks[0] + nb)):
            parts = [p[blocks[0]:blocks[0] + nb] for p in pool.parts]
        else:
            key = ("blocks", tuple(blocks), pool.k.device)
            idx = self._index_memo.get(key)
            if idx is None:
                idx = self._memo_index(key, torch.tensor(blocks, dtype=torch.long), pool.k.device)
            parts = [p.index_select(0, idx) for p in pool.parts]
        k, v = self._dequantized(pool, [p.reshape(-1, *p.shape[2:])[:length] for p in parts])
        return k.transpose(0, 1), v.transpose(0, 1)

    def read_padded(self, layer: int, seqs: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """Keys and values of the first `length` positions of several (sequence, length), padded to the
        longest: K, V [B, kv_heads, L, head_dim] and a bool [B, L] marking the real positions."""
        pool = self.pools[layer]
        device = pool.k.device
        longest = max(length for _, length in seqs)
        key = ("padded", device, longest, *((length, tuple(seq.block_table[:-(-length // BLOCK_SIZE)]))
                                            for seq, length in seqs))
        rows = self._index_memo.get(key)
        valid = self._index_memo.get(("valid", *key[1:]))
        if rows is None or valid is None:
            pos = torch.arange(longest)
            width = -(-longest // BLOCK_SIZE)
            tables = torch.tensor([blocks + (0,) * (width - len(blocks)) for _, blocks in key[3:]])
            lengths = torch.tensor([length for length, _ in key[3:]])
            real = pos[None, :] < lengths[:, None]                             # [B, L]
            flat = torch.where(real, tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
            rows = self._memo_index(key, flat.reshape(-1), device)
            valid = self._memo_index(("valid", *key[1:]), real, device)
        parts = [p.view(-1, *p.shape[2:]).index_select(0, rows) for p in pool.parts]
        k, v = self._dequantized(pool, parts)
        shape = (len(seqs), longest, *k.shape[1:])
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2), valid

    def _dequantized(self, pool: LayerPool, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, kv_heads, head_dim] in the model's dtype from a pool's stored parts."""
        if not pool.fp8:
            return parts[0], parts[1]
        k, v, ks, vs = parts
        return (k.view(torch.float8_e4m3fn).to(self.dtype) * ks[..., None].to(self.dtype),
                v.view(torch.float8_e4m3fn).to(self.dtype) * vs[..., None].to(self.dtype))

    def close(self) -> None:
        for i, pool in enumerate(self.pools):
            if pool.on_gpu and pool.k is not None:
                self.accel.unbook(pool.capacity * pool.block_bytes(), "kv")
            pool.parts = None
            pool.on_gpu = False
        self.free_blocks, self.n_blocks = [], 0
        self.refs.clear(), self.hash_of.clear(), self.block_of.clear(), self.evictable.clear()
