"""The paged KV cache: fixed-size blocks, a block table per sequence, each layer's blocks where its
attention runs.

Logical block ids are shared by all layers (one block table per sequence); every layer keeps its keys
and values in a pool indexed by those ids, on the GPU (booked under "kv") or in host memory. Re-planning
moves a layer's blocks between the two one by one; a sequence grows block by block and can be cut back.

Prefix caching: a full block is known by the hash of (its parent block's hash, its tokens). A sequence
that is released leaves its full blocks cached (reference count 0, least recently used first out); a new
sequence whose tokens start the same way takes those blocks instead of recomputing them, so a new chat
turn, or a return to an older conversation, only computes what is new.

Host-RAM tier: blocks leaving VRAM are copied to host memory instead of being dropped, and come back by
copy, not recompute. Cached blocks that a new allocation would take (least recently used first), blocks
past a capacity cut (`shrink`, on a budget drop) and every block of a sequence set aside with `offload`
go there; `match_prefix` finds cached blocks in either tier, and `restore` brings an offloaded sequence
back. A host slot holds one block of every layer (pinned memory when the GPU is CUDA, so copies run at
PCIe speed); the tier is allocated in chunks as it fills, up to a byte cap, and its unused cached slots
go least recently used first. Layers whose attention runs on the CPU already keep their pool in host
memory: their rows are copied host to host with the rest, so a block's id can be handed out again.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice

import torch

from engine import kernels
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
    host_slots: list[int] = field(default_factory=list)   # while offloaded: its blocks' host-tier slots

    @property
    def offloaded(self) -> bool:
        return bool(self.host_slots)


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
        return sum(math.prod(shape) * dt.itemsize for shape, dt in self.part_specs())

    @property
    def k(self) -> torch.Tensor | None:
        return None if self.parts is None else self.parts[0]

    @property
    def capacity(self) -> int:
        return 0 if self.parts is None else self.parts[0].shape[0]


DEFAULT_HOST_KV_BYTES = 4 << 30   # host-tier cap unless set: 4 GiB, or a quarter of the free RAM if less
# The host tier grows by chunks of about this size. A spill or restore copies a run of consecutive blocks per
# layer and part, and a run ends at a chunk's end: a 4096-token prompt of the Llama-3-8B shape was 8 runs, 512
# copies issued one by one for the layers whose KV is on the GPU (14 ms of host time at 8 GiB, session 25,
# call BL). Since chunks are pinned piece by piece and given up when a request starts, their size no longer
# sets how long a request can wait on the pinning: 2 runs now.
HOST_CHUNK_BYTES = 256 << 20


def default_host_kv_bytes() -> int:
    """4 GiB, or a quarter of the RAM available now where that is less."""
    try:
        import psutil

        return min(DEFAULT_HOST_KV_BYTES, psutil.virtual_memory().available // 4)
    except (ImportError, OSError, RuntimeError):   # psutil missing or unable to read it: the fixed default
        return DEFAULT_HOST_KV_BYTES


class HostTier:
    """Host-memory slots, each holding one KV block of every layer (all parts: k, v and fp8 scales).

    Slot s lives in chunk s // chunk_slots; a chunk is one buffer per layer and part (pinned when `pin`),
    a [n, *block shape] view, allocated when first needed, never more than `cap_bytes` in all. Pinning is
    slow (~0.5 s per GiB) and stalls the other threads: a spill beside a GPU takes only room pinned already,
    and `grow_ahead` pins what the next spill will want on a thread while no request runs. One lock guards
    the chunks and the free list; chunks are made one at a time under another, and pinned outside the
    first, so a slot taken from room already there never waits for a chunk being pinned. The grower pins a
    chunk piece by piece and gives it up when a request starts (`set_idle(False)`): the pieces go back to
    PyTorch's pinned cache, which hands them out again at once when the grower tries anew. Session 25, call
    BL: a request right after another met the grower pinning a whole 64 MiB chunk (30-42 ms); the first
    step's plan activation and its KV spill ran that much slower beside it (a 512-token prompt's spill of 64
    MiB, 2.9 ms alone, took 29 ms). A pinned tier's chunks hold a power of two of slots, so the pieces are
    not rounded up by that cache."""

    def __init__(self, pools: list[LayerPool], cap_bytes: int, pin: bool):
        self.specs = [p.part_specs() for p in pools]
        self.part_bytes = [[math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in specs]
                           for specs in self.specs]
        self.slot_bytes = sum(map(sum, self.part_bytes))
        self.pin = pin
        self.chunks: list[tuple[list[torch.Tensor], list[list[torch.Tensor]]]] = []   # (pieces, views)
        self.free: list[int] = []
        self._lock = threading.Lock()
        self._make_lock = threading.Lock()     # one chunk made at a time (held while it is pinned)
        self._grower: threading.Thread | None = None
        self._target = 0           # free slots the grower pins up to
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self.set_cap(cap_bytes)

    def set_cap(self, cap_bytes: int) -> None:
        """Set the cap; only valid while nothing is allocated."""
        assert not self.chunks
        self.cap_bytes = max(int(cap_bytes), 0)
        self.cap_slots = self.cap_bytes // self.slot_bytes if self.slot_bytes else 0
        slots = max(1, min(HOST_CHUNK_BYTES // max(self.slot_bytes, 1), self.cap_slots))
        self.chunk_slots = 1 << (slots.bit_length() - 1) if self.pin else slots

    @property
    def allocated_slots(self) -> int:
        return min(len(self.chunks) * self.chunk_slots, self.cap_slots)

    @property
    def allocated_bytes(self) -> int:
        return sum(piece.numel() for pieces, _ in list(self.chunks) for piece in pieces)

    def room(self, allocate: bool = True) -> int:
        """Slots that can be taken without dropping anything (`allocate` False: without allocating)."""
        with self._lock:
            return len(self.free) + (self.cap_slots - self.allocated_slots if allocate else 0)

    def take(self, allocate: bool = True) -> int | None:
        while True:
            with self._lock:
                if self.free:
                    self.free.sort()  # lowest first: a sequence's slots stay contiguous (fewer, larger copies)
                    return self.free.pop(0)
                if not allocate or self.allocated_slots >= self.cap_slots or self._closed:
                    return None
            self._add_chunk()

    def give(self, slot: int) -> None:
        with self._lock:
            self.free.append(slot)

    def prewarm(self, n_bytes: int) -> None:
        """Allocate chunks for `n_bytes` of slots now, so a budget drop that spills KV here never waits
        for an allocation."""
        while True:
            with self._lock:
                if self._closed or self.allocated_slots >= self.cap_slots or self.allocated_bytes >= n_bytes:
                    return
            self._add_chunk()

    def grow_ahead(self, n_slots: int) -> None:
        """Make sure `n_slots` free slots (within the cap) are allocated soon: pinned on a thread while the
        cache is idle (`set_idle`), since pinning holds the process's memory map and stalls every other
        thread's page faults (a 4096-token prefill beside it lost ~25 ms per 64 MiB chunk, H200)."""
        with self._lock:
            self._target = max(self._target, n_slots)
        self._start_grower()

    def set_idle(self, idle: bool) -> None:
        """No sequence is running (True) or one is (False): a running grower stops after its chunk."""
        if idle == self._idle.is_set():
            return
        if idle:
            self._idle.set()
            self._start_grower()
        else:
            self._idle.clear()

    def _start_grower(self) -> None:
        with self._lock:
            if self._grower is not None or self._closed or not self._idle.is_set() or not self._short():
                return
            self._grower = threading.Thread(target=self._grow_run, name="slipstream-host-kv-pin", daemon=True)
            self._grower.start()

    def _short(self) -> bool:
        return len(self.free) < self._target and self.allocated_slots < self.cap_slots

    def _grow_run(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._short() or not self._idle.is_set():
                    if not self._short():
                        self._target = 0
                    self._grower = None
                    return
            self._add_chunk(stop=lambda: not self._idle.is_set() or self._closed)

    def wait_grown(self) -> None:
        grower = self._grower
        if grower is not None:
            grower.join()

    def _add_chunk(self, stop=None) -> bool:
        """Make the next chunk (called without `_lock`; it is taken only to read and to add). `stop`: asked
        before each piece; True gives the chunk up. Whether a chunk was added."""
        with self._make_lock:
            with self._lock:
                first = self.allocated_slots
                n = min(self.chunk_slots, self.cap_slots - first)
                if n <= 0 or self._closed:
                    return False
            pieces, views = [], []
            for specs in self.specs:
                layer = []
                for shape, dt in specs:
                    if stop is not None and stop():
                        return False
                    nbytes = n * math.prod(shape) * torch.tensor([], dtype=dt).element_size()
                    pieces.append(self._new_buffer(nbytes))
                    layer.append(pieces[-1].view(dt).view(n, *shape))
                views.append(layer)
            with self._lock:
                if self._closed:
                    return False
                self.chunks.append((pieces, views))
                self.free.extend(range(first, first + n))
                return True

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def rows(self, layer: int, slot: int, n: int) -> list[torch.Tensor]:
        """Views of slots slot..slot+n-1 (in one chunk) of one layer, one per part."""
        c, r = divmod(slot, self.chunk_slots)
        return [v[r:r + n] for v in self.chunks[c][1][layer]]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.chunks.clear()
            self.free.clear()
        self.wait_grown()


def _copy_pairs(moves: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy (dst, src) pairs: one native call over the CPU pool where every pair is in host memory, else one
    PyTorch copy each."""
    if moves and not kernels.copy_many(moves):
        with torch.inference_mode():
            for dst, src in moves:
                dst.copy_(src)


def _runs(pairs: list[tuple[int, int]], chunk: int) -> list[tuple[int, int, int]]:
    """(block, slot) pairs as (first block, first slot, length) runs, consecutive on both sides and
    within one host chunk, so a run is one copy per layer and part."""
    out: list[list[int]] = []
    for b, s in pairs:
        if out and b == out[-1][0] + out[-1][2] and s == out[-1][1] + out[-1][2] and s // chunk == out[-1][1] // chunk:
            out[-1][2] += 1
        else:
            out.append([b, s, 1])
    return [tuple(r) for r in out]


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, accel: Accelerator | None, fp8: bool = False,
                 host_bytes: int | None = None):
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
        # Host tier: slot -> chain hash (None: private to one offloaded sequence), sequences holding a
        # slot, chain hash -> slot, and the cached slots no sequence holds (oldest first).
        self._pinned = accel is not None and accel.kind == "cuda"
        self.host = HostTier(self.pools, default_host_kv_bytes() if host_bytes is None else host_bytes,
                             pin=self._pinned)
        self.host_hash: dict[int, int | None] = {}
        self.host_refs: dict[int, int] = {}
        self.host_block_of: dict[int, int] = {}
        self.host_lru: OrderedDict[int, None] = OrderedDict()
        self.host_stats = {"spilled_blocks": 0, "offloaded_blocks": 0, "restored_blocks": 0,
                           "hit_blocks": 0, "dropped_blocks": 0}
        self._users: weakref.WeakValueDictionary[int, Sequence] = weakref.WeakValueDictionary()
        # A spill's copies between host memory on both sides run on a thread of their own, a layer at a
        # time, while the step that asked for the blocks starts (`_spill`); whatever next touches a layer's
        # pool or the tier waits for them (`ready`, `_settle_spills`)
        self.background_spill = os.environ.get("SLIPSTREAM_KV_SPILL_THREAD", "1").lower() not in (
            "0", "off", "false", "no")
        self._spiller: ThreadPoolExecutor | None = None
        self._spilling: dict[int, Future] = {}              # layer -> its latest spill copies
        self._spill_stream = None                           # CUDA: the GPU layers' spill copies
        self._spill_events: dict[int, torch.cuda.Event] = {}   # layer -> the end of its latest ones

    def set_host_capacity(self, n_bytes: int) -> None:
        """The host tier's cap in bytes (before anything was moved there)."""
        self.host.set_cap(n_bytes)

    # ---- block allocation ----------------------------------------------------------------------
    def _grow(self, n_blocks: int) -> None:
        """Make every pool hold `n_blocks` logical blocks. Beside a GPU the host tier then pins room for
        as many on a thread (within its cap), so that spilling them later keeps them."""
        for i, pool in enumerate(self.pools):
            if pool.on_gpu or pool.capacity < n_blocks:    # (a host pool kept from before a cut has room)
                self._resize(i, pool, n_blocks, pool.on_gpu)
        self.free_blocks.extend(range(self.n_blocks, n_blocks))
        self.n_blocks = n_blocks
        if self._pinned:
            self.host.grow_ahead(n_blocks)

    def _resize(self, layer: int, pool: LayerPool, n_blocks: int, on_gpu: bool) -> None:
        """Reallocate one layer's pool with `n_blocks` blocks on the GPU or host, keeping its contents.
        The booking changes by the difference only, so a pool that grows in place never double-books."""
        self.ready(layer)
        old_parts = pool.parts
        keep = min(pool.capacity, n_blocks)
        device = self.accel.device if on_gpu else torch.device("cpu")
        new_bytes = n_blocks * pool.block_bytes() if on_gpu else 0
        old_bytes = pool.capacity * pool.block_bytes() if pool.on_gpu else 0
        if new_bytes > old_bytes:
            self.accel.book(new_bytes - old_bytes, "kv", f"KV cache of layer {layer}")
        try:
            parts = self._new_parts_or_release(pool, n_blocks, on_gpu, device)
        except torch.OutOfMemoryError:
            if new_bytes > old_bytes:
                self.accel.unbook(new_bytes - old_bytes, "kv")
            if on_gpu and pool.on_gpu and n_blocks <= pool.capacity:
                # A GPU pool cut down while VRAM is short (the re-plan after an out-of-memory cuts the KV
                # before the weights leave) cannot take new VRAM to shrink into: it moves to host memory,
                # and the plan's activation brings it back once the weights leaving have made room (an
                # attention finding its pool on the wrong side moves it too). Nothing written is lost.
                self._resize(layer, pool, n_blocks, False)
                return
            raise
        if keep:   # one copy a part (straight between the two buffers: nothing else is allocated). Block by
            # block it was 2 x 32 x the kept blocks' copies: the activation before the Llama-3-8B shape's first
            # 4096-token prompt after shorter ones went 341 -> 212 ms at 8 GiB (session 24, calls BH, BJ0)
            moves = [(new_part[:keep], old_part[:keep]) for new_part, old_part in zip(parts, old_parts)]
            _copy_pairs(moves)           # (one native call where both sides are in host memory)
        # Rows no token has written yet are zeros, never leftover bytes: a padded read (a batch's shorter
        # sequences, a captured decode attention's padded context) gathers them under a mask, and a
        # masked NaN still poisons the softmax's weighted sum (0 x NaN)
        for part in parts:
            part[keep:].zero_()
        pool.parts, pool.on_gpu = parts, on_gpu
        if old_bytes > new_bytes:
            self.accel.unbook(old_bytes - new_bytes, "kv")

    def _new_parts(self, pool: LayerPool, n_blocks: int, on_gpu: bool, device) -> list[torch.Tensor]:
        # Host pools are pinned beside a GPU: attention streamed over a host-resident KV cache copies
        # straight between them and the GPU without blocking the host.
        pin = self._pinned and not on_gpu
        return [torch.empty((n_blocks, *shape), dtype=dt, device=device, pin_memory=pin)
                for shape, dt in pool.part_specs()]

    def _new_parts_or_release(self, pool: LayerPool, n_blocks: int, on_gpu: bool, device) -> list[torch.Tensor]:
        """`_new_parts`; on the GPU, once more after an out-of-memory with the allocator's cached blocks
        given back. The booking fits the budget, so what stands in the way is those cached free blocks,
        which count against the allocator's cap (session 25, call BJ: the MoE shape at 2 GiB, a context
        grown in batched decode, a pool's 2 MiB refused with 228 MiB reserved and unused)."""
        try:
            return self._new_parts(pool, n_blocks, on_gpu, device)
        except torch.OutOfMemoryError:
            if not on_gpu:
                raise
            self.accel.release_to_driver()
            return self._new_parts(pool, n_blocks, on_gpu, device)

    def _alloc_blocks(self, n: int) -> list[int]:
        """`n` blocks for new contents: free ones first (lowest ids), then cached ones least recently
        used first (moved to the host tier), growing every pool when even that is not enough."""
        if n <= 0:
            return []
        spare = len(self.free_blocks) + len(self.evictable)
        if spare < n:
            self._grow(self.n_blocks + n - spare)
        short = n - len(self.free_blocks)
        if short > 0:
            self._spill(list(islice(self.evictable, short)))
        self.free_blocks.sort()       # lowest ids first keeps a lone sequence's blocks contiguous
        out = self.free_blocks[:n]
        del self.free_blocks[:n]
        return out

    @torch.inference_mode()
    def reserve(self, seq: Sequence, n_new: int) -> None:
        """Give `seq` blocks for `n_new` more tokens."""
        self.host.set_idle(False)
        if seq.host_slots:
            self.restore(seq)
        need = -(-(seq.length + n_new) // BLOCK_SIZE) - len(seq.block_table)
        if need <= 0:
            return
        for block in self._alloc_blocks(need):
            self.refs[block] = 1
            seq.block_table.append(block)
        self._users[id(seq)] = seq

    def cached_prefix(self, token_ids: list[int], host: bool = True) -> int:
        """How many tokens `match_prefix` would reuse for `token_ids` now, changing nothing (`host` False:
        only those whose blocks are in the pools, not in the host tier)."""
        n = 0
        for h in block_hashes(token_ids[:(len(token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE]):
            if h not in self.block_of and not (host and h in self.host_block_of):
                break
            n += BLOCK_SIZE
        return n

    @torch.inference_mode()
    def match_prefix(self, seq: Sequence, token_ids: list[int]) -> int:
        """Start an empty `seq` with the cached blocks of the longest cached prefix of `token_ids` (at
        least one token is always left to compute), copying back those found in the host tier. Returns
        the number of tokens reused."""
        assert not seq.block_table and not seq.host_slots
        self.host.set_idle(False)
        usable = (len(token_ids) - 1) // BLOCK_SIZE
        from_host: list[tuple[int, int, int]] = []           # (index in the table, host slot, hash)
        hashes = block_hashes(token_ids[:usable * BLOCK_SIZE])
        for h in hashes:
            block = self.block_of.get(h)
            if block is not None:
                self.evictable.pop(block, None)
                self.refs[block] = self.refs.get(block, 0) + 1
            else:
                slot = self.host_block_of.get(h)
                if slot is None:
                    break
                self._host_hold(slot)
                from_host.append((len(seq.block_table), slot, h))
                block = -1
            seq.block_table.append(block)
        self._users[id(seq)] = seq
        try:
            blocks = self._alloc_blocks(len(from_host))
        except BaseException:            # the pools could not grow: leave everything as it was
            for _, slot, _ in from_host:
                self._host_unhold(slot)
            for block, h in zip(seq.block_table, hashes):
                if block >= 0:
                    self._drop(block, h)
            seq.block_table = []
            raise
        self._copy_back([(i, slot, h, b) for (i, slot, h), b in zip(from_host, blocks)], seq)
        self.host_stats["hit_blocks"] += len(from_host)
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
        if seq.host_slots:
            if length > 0:
                self.restore(seq)
            else:
                for slot in seq.host_slots:
                    self._host_unhold(slot)
                seq.host_slots = []
        length = min(length, seq.length)
        keep = -(-length // BLOCK_SIZE)
        hashes = block_hashes(seq.token_ids[:seq.length]) if seq.cacheable else []
        for i in range(len(seq.block_table) - 1, keep - 1, -1):
            self._drop(seq.block_table[i], hashes[i] if i < len(hashes) else None)
        del seq.block_table[keep:]
        seq.length = length
        del seq.token_ids[length:]

    def request_started(self) -> None:
        """A request is starting: the host tier stops pinning before its plan activation and first step
        (set idle again when the last sequence is released)."""
        self.host.set_idle(False)

    def release(self, seq: Sequence) -> None:
        self.truncate(seq, 0)
        self.idle_if_unused()

    def idle_if_unused(self) -> None:
        """Where no sequence holds a block any more (idle), the host tier may pin the room it wants now."""
        if not self.refs:
            self.host.set_idle(True)

    def blocks_in_use(self) -> int:
        return len(self.refs)

    # ---- the host tier -------------------------------------------------------------------------
    def _host_hold(self, slot: int) -> None:
        self.host_lru.pop(slot, None)
        self.host_refs[slot] = self.host_refs.get(slot, 0) + 1

    def _host_unhold(self, slot: int) -> None:
        """One offloaded sequence stops holding `slot`: a cached one joins the LRU, a private one is freed."""
        self.host_refs[slot] -= 1
        if self.host_refs[slot] > 0:
            return
        del self.host_refs[slot]
        if self.host_hash[slot] is None:
            del self.host_hash[slot]
            self.host.give(slot)
        else:
            self.host_lru[slot] = None
            self.host_lru.move_to_end(slot)

    def _host_take(self, h: int | None, allocate: bool = True) -> int | None:
        """A host slot for a block of chain hash `h` (None: private): a free one, else the least
        recently used cached one; None when every slot is held by an offloaded sequence (`allocate`
        False: or when no allocated slot is free)."""
        slot = self.host.take(allocate)
        if slot is None and self.host_lru:
            slot, _ = self.host_lru.popitem(last=False)
            del self.host_block_of[self.host_hash.pop(slot)]
            self.host_stats["dropped_blocks"] += 1
        if slot is not None:
            self.host_hash[slot] = h
            if h is not None:
                self.host_block_of[h] = slot
        return slot

    def _host_room(self, keep: set[int] = frozenset(), allocate: bool = True) -> int:
        """Host slots that can be taken, dropping cached ones but not those in `keep`."""
        return self.host.room(allocate) + len(self.host_lru) - sum(1 for s in keep if s in self.host_lru)

    def _copy(self, pairs: list[tuple[int, int]], to_host: bool, background: bool = False) -> None:
        """Copy (pool block, host slot) pairs, every layer, in runs. On CUDA the copies are queued on
        the compute stream: whatever later reads or overwrites either side is ordered after them. The
        copies between host memory on both sides (a layer whose cache is in host memory) go in one native
        call over the CPU pool (`kernels.copy_many`), else one PyTorch copy each; with `background` (a
        spill's), a call per layer on the spill thread, in layer order, and beside a GPU the copies out of
        its pools on a stream of their own, an event per layer (see `ready`)."""
        background = background and self.background_spill
        if not background:
            self._settle_spills()
        on_host: dict[int, list] = {}
        off_gpu: dict[int, list] = {}
        for block, slot, n in _runs(pairs, self.host.chunk_slots):
            for layer, pool in enumerate(self.pools):
                nb = pool.on_gpu and self._pinned
                for part, host in zip(pool.parts, self.host.rows(layer, slot, n)):
                    dst, src = (host, part[block:block + n]) if to_host else (part[block:block + n], host)
                    if dst.device.type == "cpu" and src.device.type == "cpu":
                        on_host.setdefault(layer, []).append((dst, src))
                    elif background and nb:
                        off_gpu.setdefault(layer, []).append((dst, src))
                    else:
                        dst.copy_(src, non_blocking=nb)
        if off_gpu:
            self._spill_off_gpu(off_gpu)
        if background and on_host:
            if self._spiller is None:
                self._spiller = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slipstream-kv-spill")
            for layer, moves in on_host.items():
                self._spilling[layer] = self._spiller.submit(_copy_pairs, moves)
            return
        _copy_pairs([m for moves in on_host.values() for m in moves])

    def _spill_off_gpu(self, moves_of: dict[int, list]) -> None:
        """Queue a spill's copies out of the GPU pools on the spill stream, after what the compute stream
        queued so far (the blocks' last writes), and record an event per layer: the step's first kernels
        no longer wait behind them on the compute stream (at 8 GiB all 32 layers' caches are there: 512 MiB
        a 4096-token prompt, about 10 ms of the link)."""
        device = self.accel.device
        if self._spill_stream is None:
            self._spill_stream = torch.cuda.Stream(device)
        stream = self._spill_stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for layer, moves in moves_of.items():
                for dst, src in moves:
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
                self._spill_events[layer] = ev

    def ready(self, layer: int) -> None:
        """Wait for the spill copies of `layer` still running on the spill thread: before anything reads or
        writes its pool (the step's cache writes into blocks the spill frees, above all). A 4096-token
        prompt's spill of the prompt before it took 7 ms at 4 GiB on the H200 host (Llama-3-8B shape, 28
        layers' caches in host memory; session 25, call BM), in front of the step's first layer: on the
        thread, layer by layer, the step's first layers run meanwhile."""
        pending = self._spilling.pop(layer, None)
        if pending is not None:
            pending.result()
        ev = self._spill_events.pop(layer, None)
        if ev is not None:           # (the GPU waits; the step's thread goes on queueing)
            torch.cuda.current_stream(self.accel.device).wait_event(ev)

    def _pool(self, layer: int) -> LayerPool:
        """`layer`'s pool, once no spill copy of it still runs."""
        self.ready(layer)
        return self.pools[layer]

    def _settle_spills(self) -> None:
        """Wait for every layer's spill copies (before an operation on every pool or on the tier's slots, which
        the CPU may read: the host waits for the GPU's copies too)."""
        for layer in list(self._spilling):
            self.ready(layer)
        for layer in list(self._spill_events):
            self._spill_events.pop(layer).synchronize()

    def _spill(self, blocks: list[int]) -> None:
        """Cached, unused blocks leave the pools: each goes to the host tier (unless it is there already
        or the tier is full of held slots) and its id becomes free."""
        fresh = []                             # (block, hash) not in the tier yet, least recently used first
        for block in blocks:
            del self.evictable[block]
            h = self.hash_of.pop(block)
            del self.block_of[h]
            self.free_blocks.append(block)
            slot = self.host_block_of.get(h)
            if slot is not None:
                if slot in self.host_lru:
                    self.host_lru.move_to_end(slot)
                continue
            fresh.append((block, h))
        # Slots are taken first and handed out in order, ascending blocks to ascending slots: the blocks
        # come least recently used first, which is a sequence's blocks backwards, and one slot per block in
        # that order made every block a copy of its own per layer (4096 tokens: 16k copies, ~0.15 s).
        # A tier with room for fewer keeps the most recently used of them (as taking a slot each in turn,
        # each dropping the least recently used, would). Beside a GPU the room is what is pinned already:
        # pinning is ~0.5 s per GiB, and a spill runs in front of a prompt's first token (a 4096-token
        # prompt of the 8B shape waited 0.22 s on it, H200); what does not fit is dropped (it is a cache),
        # and the tier pins room for the next spill on a thread.
        alloc = not self._pinned
        chosen = fresh[max(len(fresh) - self._host_room(allocate=alloc), 0):]
        slots = [s for s in (self._host_take(None, alloc) for _ in chosen) if s is not None]
        chosen = chosen[len(chosen) - len(slots):]
        slot_of = dict(zip(sorted(b for b, _ in chosen), sorted(slots)))
        for block, h in chosen:                # the tier's recency keeps the pools' order
            slot = slot_of[block]
            self.host_hash[slot], self.host_block_of[h] = h, slot
            self.host_lru[slot] = None
        self._copy(sorted(slot_of.items()), to_host=True, background=True)
        self.host_stats["spilled_blocks"] += len(fresh)
        self.host_stats["dropped_blocks"] += len(fresh) - len(chosen)
        if self._pinned and fresh:             # the next spill is likely as large: pin its room meanwhile
            self.host.grow_ahead(len(fresh))

    def _copy_back(self, items: list[tuple[int, int, int | None, int]], seq: Sequence) -> None:
        """(index in seq's table, host slot, hash, new block): copy each slot into its block, put the
        block in the table (known by its hash to later lookups) and let the slot go."""
        for i, slot, h, block in items:
            self.refs[block] = 1
            seq.block_table[i] = block
            if h is not None and h not in self.block_of:
                self.hash_of[block], self.block_of[h] = h, block
        self._copy([(block, slot) for _, slot, _, block in items], to_host=False)
        for _, slot, _, _ in items:
            self._host_unhold(slot)
        self.host_stats["restored_blocks"] += len(items)

    @torch.inference_mode()
    def offload(self, seq: Sequence) -> bool:
        """Move every block of `seq` to the host tier and free its pool blocks (its tokens and length
        stay; `restore` or the next `reserve` brings the KV back bit for bit). Blocks whose chain hash is
        in the tier already are shared, not copied again. Returns False, changing nothing, when the tier
        has no room for them."""
        if seq.host_slots or not seq.block_table:
            return True
        hashes = block_hashes(seq.token_ids[:seq.length]) if seq.cacheable else []
        plan = [(b, hashes[i] if i < len(hashes) else None) for i, b in enumerate(seq.block_table)]
        known = {self.host_block_of[h] for _, h in plan if h in self.host_block_of}
        if self._host_room(known) < sum(1 for _, h in plan if h not in self.host_block_of):
            return False
        for slot in known:            # held first, so that taking new slots cannot drop them
            self._host_hold(slot)
        slots, pairs = [], []
        for block, h in plan:
            slot = self.host_block_of.get(h) if h is not None else None
            if slot is None:
                slot = self._host_take(h)
                self._host_hold(slot)
                pairs.append((block, slot))
            slots.append(slot)
        self._copy(pairs, to_host=True)
        for block, _ in plan:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                del self.refs[block]
                if block in self.hash_of:
                    del self.block_of[self.hash_of.pop(block)]
                self.free_blocks.append(block)
        seq.block_table, seq.host_slots = [], slots
        self.host_stats["offloaded_blocks"] += len(pairs)
        return True

    @torch.inference_mode()
    def restore(self, seq: Sequence) -> None:
        """Bring an offloaded `seq` back into the pools: blocks still cached there are taken as they are,
        the rest are copied from the host tier."""
        if not seq.host_slots:
            return
        slots = seq.host_slots
        table: list[int] = []
        items, in_pool = [], []
        for i, slot in enumerate(slots):
            h = self.host_hash[slot]
            block = self.block_of.get(h) if h is not None else None
            if block is not None:
                self.evictable.pop(block, None)
                self.refs[block] = self.refs.get(block, 0) + 1
                in_pool.append(slot)
            else:
                items.append((i, slot, h))
                block = -1
            table.append(block)
        try:
            blocks = self._alloc_blocks(len(items))
        except BaseException:
            for block, slot in zip(table, slots):
                if block >= 0:
                    self._drop(block, self.host_hash[slot])
            raise
        seq.block_table, seq.host_slots = table, []
        self._users[id(seq)] = seq
        self._copy_back([(i, slot, h, b) for (i, slot, h), b in zip(items, blocks)], seq)
        for slot in in_pool:
            self._host_unhold(slot)

    @torch.inference_mode()
    def evict_cached(self, n: int | None = None) -> int:
        """Move the `n` least recently used cached blocks (all by default) out of the pools into the host
        tier; their pool blocks become free. Returns how many left the pools."""
        victims = list(islice(self.evictable, n))
        self._spill(victims)
        return len(victims)

    def host_report(self) -> dict:
        """Host-tier figures for `stats()`."""
        held = len(self.host_hash)
        return {"host_kv_bytes": held * self.host.slot_bytes,
                "host_kv_allocated_bytes": self.host.allocated_bytes,
                "host_kv_cap_bytes": self.host.cap_bytes,
                "host_kv_blocks": held, "host_kv_hits": self.host_stats["hit_blocks"],
                "host_kv_restores": self.host_stats["restored_blocks"],
                "host_kv_offloads": self.host_stats["offloaded_blocks"] + self.host_stats["spilled_blocks"],
                "host_kv_dropped": self.host_stats["dropped_blocks"]}

    # ---- placement -----------------------------------------------------------------------------
    def place_layer(self, layer: int, on_gpu: bool) -> None:
        pool = self._pool(layer)
        if pool.on_gpu != on_gpu:
            self._resize(layer, pool, self.n_blocks, on_gpu)
            pool.on_gpu = on_gpu

    def gpu_bytes(self) -> int:
        return sum(p.capacity * p.block_bytes() for p in self.pools if p.on_gpu)

    @torch.inference_mode()
    def shrink(self, n_blocks: int) -> None:
        """Cut every pool to `n_blocks` blocks (never below the blocks in use): cached blocks past the cut,
        and as many of the oldest others as the in-use blocks past the cut need room for, go to the host
        tier; in-use blocks past the cut move below it (every sequence's table follows)."""
        self._settle_spills()
        target = max(n_blocks, len(self.refs))
        if target >= self.n_blocks:
            return
        above = sorted(b for b in self.refs if b >= target)
        free_below = sum(1 for b in self.free_blocks if b < target)
        cached_below = [b for b in self.evictable if b < target]
        self._spill([b for b in self.evictable if b >= target] + cached_below[:max(0, len(above) - free_below)])
        self._settle_spills()                  # (the moves below write blocks that spill reads)
        dest = sorted(b for b in self.free_blocks if b < target)[:len(above)]
        moved = dict(zip(above, dest))
        # One copy per run of blocks consecutive on both sides (a cut runs on a budget drop, the game waiting;
        # sources lie past the cut and destinations below it, so a run never overlaps itself)
        for src, dst, n in _runs(list(moved.items()), self.n_blocks + 1) if moved else ():
            for pool in self.pools:
                for part in pool.parts:
                    part[dst:dst + n].copy_(part[src:src + n])
        for src, dst in moved.items():
            self.refs[dst] = self.refs.pop(src)
            if src in self.hash_of:
                h = self.hash_of.pop(src)
                self.hash_of[dst], self.block_of[h] = h, dst
        if moved:
            for seq in list(self._users.values()):
                seq.block_table = [moved.get(b, b) for b in seq.block_table]
        taken = set(dest)
        self.free_blocks = [b for b in self.free_blocks if b < target and b not in taken]
        for i, pool in enumerate(self.pools):
            # A cut gives VRAM back; a host pool keeps its room (its rows past the cut hold old keys and values,
            # finite, as a freed block's do), so the next long prompt does not pin and fill it afresh: on the
            # H200 host the first 4096-token prompt after shorter ones spent 172 ms (4 GiB) and 385 ms (8 GiB)
            # re-making the host pools of the Llama-3-8B shape before its first step (session 24, call BG)
            if pool.on_gpu:
                self._resize(i, pool, target, True)
        self.n_blocks = target

    def forget_cached(self) -> None:
        """Drop every cached (unused) block, in the pools and in the host tier."""
        self._settle_spills()
        for block in list(self.evictable):
            del self.block_of[self.hash_of.pop(block)]
            self.free_blocks.append(block)
        self.evictable.clear()
        for slot in list(self.host_lru):
            del self.host_block_of[self.host_hash.pop(slot)]
            self.host.give(slot)
        self.host_lru.clear()

    # ---- reads and writes ----------------------------------------------------------------------
    def write(self, layer: int, seq: Sequence, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, n, head_dim] for positions start..start+n-1."""
        self.write_many(layer, [(seq, start, k.shape[1])], k, v)

    def write_many(self, layer: int, segments: list[tuple[Sequence, int, int]], k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """The new keys and values of several sequences at once (a batched step): k, v [kv_heads, N,
        head_dim] hold the tokens of each segment (sequence, start, n) one after another."""
        pool = self._pool(layer)
        flat = self._slot_index(segments, pool.k.device)
        values = self._quantized(pool, k.transpose(0, 1), v.transpose(0, 1))   # [n, kv_heads, head_dim]
        for part, value in zip(pool.parts, values):
            part.view(-1, *part.shape[2:]).index_copy_(0, flat, value)

    def _quantized(self, pool: LayerPool, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        """What a pool stores of keys and values [n, kv_heads, head_dim]: the parts in its dtypes."""
        values = [k, v]
        if pool.fp8:
            scales = [t.abs().amax(-1).float().clamp(min=1e-12) / FP8_MAX for t in values]
            values = [(t.float() / sc[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
                      for t, sc in zip(values, scales)] + scales
        return [value.to(part_dtype) for value, (_, part_dtype) in zip(values, pool.part_specs())]

    def as_stored(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [kv_heads, n, head_dim] as a read after writing them would return them (an FP8 pool
        rounds them), on their own device."""
        pool = self._pool(layer)
        k2, v2 = self._dequantized(pool, self._quantized(pool, k.transpose(0, 1), v.transpose(0, 1)))
        return k2.transpose(0, 1), v2.transpose(0, 1)

    def write_from_device(self, layer: int, segments: list[tuple[Sequence, int, int]], k: torch.Tensor,
                          v: torch.Tensor) -> None:
        """write_many for keys and values on the GPU into a host pool: copies queued on the current
        stream, one per run of consecutive pool rows, so the host does not wait. Host readers of the pool
        come after the step, which ends by waiting for the stream."""
        pool = self._pool(layer)
        values = [t.contiguous() for t in self._quantized(pool, k.transpose(0, 1), v.transpose(0, 1))]
        flat = self._slot_index(segments, torch.device("cpu"))
        cuts = (torch.nonzero(flat[1:] != flat[:-1] + 1).flatten() + 1).tolist()   # where a run of rows breaks
        bounds = list(zip([0, *cuts], [*cuts, len(flat)]))
        starts = flat[[a for a, _ in bounds]].tolist()
        for part, value in zip(pool.parts, values):
            rows = part.view(-1, *part.shape[2:])
            for (a, b), row in zip(bounds, starts):
                rows[row:row + b - a].copy_(value[a:b], non_blocking=True)

    def read_to(self, layer: int, seq: Sequence, length: int, device: torch.device) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """read() of a host pool onto `device`: the stored parts are copied without blocking the host (the
        pool's blocks as they lie where they are consecutive, else gathered into pinned memory where
        `device` is a GPU), then dequantized there. A gathered copy in pageable memory had made each copy
        wait for the GPU's queue: on the H200 a 4096-token prompt's 1024-token steps at a 2 GiB budget spent
        0.68 s of 1.39 s in those copies once the sequence's blocks were out of order (session 12)."""
        pool = self._pool(layer)
        pin = device.type == "cuda" and pool.k.device.type == "cpu"
        parts = [p.reshape(-1, *p.shape[2:])[:length] for p in self._block_parts(pool, seq, length, pin)]
        k, v = self._dequantized(pool, [p.to(device, non_blocking=True) for p in parts])
        return k.transpose(0, 1), v.transpose(0, 1)

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

    def positions_index(self, starts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch row, position) index pair of a padded [B, L, ...] batch's entries (i, starts[i]), on
        `device`; kept for the step's other layers."""
        key = ("positions", device, *starts)
        at = self._index_memo.get(key)
        if at is None:
            at = self._memo_index(key, torch.tensor([list(range(len(starts))), starts], dtype=torch.long), device)
        return at[0], at[1]

    def _memo_index(self, key: tuple, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Keep an index tensor (moved to `device` once: a copy to the GPU waits for its queue) for the
        other layers of the step; the memo holds the last few steps' indexes of a batch."""
        if len(self._index_memo) >= 1024:
            self._index_memo.clear()
        index = self._index_memo[key] = index.to(device)
        return index

    def read(self, layer: int, seq: Sequence, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `length` positions: [kv_heads, length, head_dim] each."""
        pool = self._pool(layer)
        parts = self._block_parts(pool, seq, length)
        k, v = self._dequantized(pool, [p.reshape(-1, *p.shape[2:])[:length] for p in parts])
        return k.transpose(0, 1), v.transpose(0, 1)

    def _block_parts(self, pool: LayerPool, seq: Sequence, length: int, pin: bool = False) -> list[torch.Tensor]:
        """The pool's blocks holding the first `length` positions of `seq`, per stored part: a view
        where the blocks are consecutive, else a gathered copy (in pinned memory with `pin`)."""
        nb = -(-length // BLOCK_SIZE)
        blocks = seq.block_table[:nb]
        if blocks == list(range(blocks[0], blocks[0] + nb)):
            return [p[blocks[0]:blocks[0] + nb] for p in pool.parts]
        key = ("blocks", tuple(blocks), pool.k.device)
        idx = self._index_memo.get(key)
        if idx is None:
            idx = self._memo_index(key, torch.tensor(blocks, dtype=torch.long), pool.k.device)
        if pin:
            return [torch.index_select(p, 0, idx, out=torch.empty((len(blocks), *p.shape[1:]), dtype=p.dtype,
                                                                  pin_memory=True)) for p in pool.parts]
        return [p.index_select(0, idx) for p in pool.parts]

    def attend_decode(self, layer: int, seqs: list[tuple[Sequence, int]], q: torch.Tensor,
                      rows: list[int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """One new query token per (sequence, length) attending over its first `length` positions (this
        step's key and value already written), through the native kernel reading the pool in place: no
        gathered copy of the context (`read`'s index_select once the pool's blocks were handed out of
        order), no SDPA and its glue ops. q, rows, out: as `kernels.paged_decode_attention`. None where it
        does not apply (the caller then reads and attends itself): an FP8 pool, tensors off the CPU, the
        kernel off or missing. Whether it applies depends on nothing but where the tensors are, so every
        plan of a simulated accelerator (all tensors on the CPU) computes the same numbers."""
        pool = self._pool(layer)
        if pool.fp8 or pool.parts is None or not pool.k.is_cpu or not q.is_cpu or not kernels.attention_ready():
            return None
        tables = [self.decode_table(seq, length) for seq, length in seqs]
        return kernels.paged_decode_attention(q, pool.parts[0], pool.parts[1], tables, [n for _, n in seqs], rows,
                                              out)

    def decode_table(self, seq: Sequence, length: int) -> torch.Tensor:
        """The block ids (int64, CPU) holding positions 0..length-1 of `seq`, kept for the step's other
        layers."""
        blocks = tuple(seq.block_table[:-(-length // BLOCK_SIZE)])
        key = ("table", blocks)
        table = self._index_memo.get(key)
        if table is None:
            table = self._memo_index(key, torch.tensor(blocks, dtype=torch.long), torch.device("cpu"))
        return table

    def read_padded(self, layer: int, seqs: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
        """Keys and values of the first `length` positions of several (sequence, length), padded to the
        longest: K, V [B, kv_heads, L, head_dim] and a bool [B, L] marking the real positions."""
        pool = self._pool(layer)
        rows, valid = self._padded_rows(seqs, pool.k.device, pool.k.device)
        parts = [p.view(-1, *p.shape[2:]).index_select(0, rows) for p in pool.parts]
        return self._padded(pool, parts, len(seqs), valid)

    def read_padded_to(self, layer: int, seqs: list[tuple[Sequence, int]],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """read_padded() of a host pool onto `device`: the sequences' rows gathered on the host in one
        pass per stored part (into pinned memory where `device` is a GPU) and copied over in one queued
        copy each (the host does not wait), then dequantized there; `valid` on `device`."""
        pool = self._pool(layer)
        rows, valid = self._padded_rows(seqs, pool.k.device, device)
        pin = device.type == "cuda"
        parts = []
        for p in pool.parts:
            flat = p.view(-1, *p.shape[2:])
            buf = torch.empty((rows.numel(), *flat.shape[1:]), dtype=flat.dtype, pin_memory=pin)
            torch.index_select(flat, 0, rows, out=buf)
            parts.append(buf.to(device, non_blocking=True))
        return self._padded(pool, parts, len(seqs), valid)

    def _padded(self, pool: LayerPool, parts: list[torch.Tensor], n: int, valid: torch.Tensor):
        k, v = self._dequantized(pool, parts)
        shape = (n, valid.shape[1], *k.shape[1:])
        return k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2), valid

    def _padded_rows(self, seqs: list[tuple[Sequence, int]], pool_device: torch.device,
                     valid_device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat pool rows of the first `length` positions of each (sequence, length), padded to the
        longest with row 0 ([B * L], on the pool's device), and the bool [B, L] marking the real ones (on
        `valid_device`); kept for the step's other layers."""
        longest = max(length for _, length in seqs)
        key = ("padded", pool_device, longest, *((length, tuple(seq.block_table[:-(-length // BLOCK_SIZE)]))
                                                 for seq, length in seqs))
        vkey = ("valid", valid_device, *key[2:])
        rows = self._index_memo.get(key)
        valid = self._index_memo.get(vkey)
        if rows is None or valid is None:
            pos = torch.arange(longest)
            width = -(-longest // BLOCK_SIZE)
            tables = torch.tensor([blocks + (0,) * (width - len(blocks)) for _, blocks in key[3:]])
            lengths = torch.tensor([length for length, _ in key[3:]])
            real = pos[None, :] < lengths[:, None]                             # [B, L]
            flat = torch.where(real, tables[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE, 0)
            rows = self._memo_index(key, flat.reshape(-1), pool_device)
            valid = self._memo_index(vkey, real, valid_device)
        return rows, valid

    def _dequantized(self, pool: LayerPool, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, kv_heads, head_dim] in the model's dtype from a pool's stored parts."""
        if not pool.fp8:
            return parts[0], parts[1]
        k, v, ks, vs = parts
        return (k.view(torch.float8_e4m3fn).to(self.dtype) * ks[..., None].to(self.dtype),
                v.view(torch.float8_e4m3fn).to(self.dtype) * vs[..., None].to(self.dtype))

    def close(self) -> None:
        self._settle_spills()
        if self._spiller is not None:
            self._spiller.shutdown()
            self._spiller = None
        for i, pool in enumerate(self.pools):
            if pool.on_gpu and pool.k is not None:
                self.accel.unbook(pool.capacity * pool.block_bytes(), "kv")
            pool.parts = None
            pool.on_gpu = False
        self.free_blocks, self.n_blocks = [], 0
        self.refs.clear(), self.hash_of.clear(), self.block_of.clear(), self.evictable.clear()
        if self._pinned:
            torch.cuda.synchronize(self.accel.device)     # no queued copy may still use a host chunk
        self.host.close()
        self.host_hash.clear(), self.host_refs.clear(), self.host_block_of.clear(), self.host_lru.clear()
