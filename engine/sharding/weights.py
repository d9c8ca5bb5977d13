"""Where each sub-layer's weights live: one flat host buffer per sub-layer, plus VRAM copies.

Every sub-layer's tensors are packed into one contiguous host buffer (pinned on CUDA, so copies run at
full PCIe speed on the copy engine). A `resident` sub-layer also has a VRAM copy of that buffer; a
`streamed` one is copied into a slot before use; a `cpu` one is computed from the host buffer. Views
(name -> tensor) are cut from whichever buffer is used, so one copy moves a whole sub-layer.

An expert group (`experts.{e}.gate/up/down.weight` for its experts, packed expert by expert) gets
stacked views instead of one view per tensor: `experts.gate.weight`, `experts.up.weight` [G, f, h],
`experts.down.weight` [G, h, f], and `experts.gate_up.weight` [G, 2f, h] where gate and up sit back to
back, so picking an expert is an index and a streamed group costs four views, not 3G.

With transfer coding (`engine.sharding.transfer_code`), a bf16 sub-layer also keeps a coded copy of its
buffer in host memory (75% of its bytes). A whole streamed copy moves that instead, through a ring of small
staging buffers booked with the slots, and the GPU decodes it into the slot: the same bytes arrive in
three quarters of the PCIe time. Routed expert copies, resident copies and the CPU read the raw buffer.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import torch

from engine.sharding.device import HOST_ALIGN as _ALIGN
from engine.sharding.device import Accelerator, host_buffers
from engine.sharding.transfer_code import (
    ESCAPE_SLICE,
    N_STAGES,
    CodedBuffer,
    CpuMatrix,
    Program,
    coded_size,
    encode_into,
    min_bytes,
    plan,
    warm_up,
)

_FUSED = {"qkv.weight": ("q.weight", "k.weight", "v.weight"), "qkv.bias": ("q.bias", "k.bias", "v.bias"),
          "gate_up.weight": ("gate.weight", "up.weight")}


@dataclass(frozen=True, slots=True)
class TensorSlot:
    local: str                  # name inside the sub-layer, e.g. "q.weight"
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def packed_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of a sub-layer's packed host buffer (each tensor aligned)."""
    return sum((t.numel() * t.element_size() + _ALIGN - 1) // _ALIGN * _ALIGN for t in tensors.values())


class SubLayerWeights:
    """The packed host buffer of one sub-layer and its layout."""

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], pin: bool, buf: torch.Tensor | None = None):
        """`buf`: the host buffer to pack into (`packed_bytes(tensors)` long); default one of its own."""
        self.name = name
        layout, off = [], 0
        for local, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            layout.append(TensorSlot(local, off, nbytes, tuple(t.shape), t.dtype))
            off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.layout = tuple(layout)
        self.nbytes = off
        if buf is None:
            buf = host_buffers([off], pin)[0]
        ends = [s.offset for s in layout[1:]] + [off]
        for s, t, end in zip(layout, tensors.values(), ends):
            buf[s.offset:s.offset + s.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
            buf[s.offset + s.nbytes:end].zero_()         # (padding: the same bytes every time)
        self.host = buf
        self._stacks = _expert_stacks(self.layout)
        self._host_views = self.views(buf)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._stacks is not None:
            return {name: buf[start:start + n * block].view(dtype).view(n, -1)[:, a:a + numel].view(n, *shape)
                    for name, start, n, block, a, numel, shape, dtype in self._stacks}
        out = {s.local: buf[s.offset:s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in self.layout}
        # Matrices packed back to back also get one fused view (one matmul instead of several: fewer
        # kernel launches on the GPU, better bandwidth on the CPU). No bytes are copied.
        for fused, parts in _FUSED.items():
            run = self._contiguous(parts)
            if run is not None:
                first, rows = run
                out[fused] = buf[first.offset:first.offset + sum(p.nbytes for p in self._slots(parts))] \
                    .view(first.dtype).view((rows,) + first.shape[1:])
        return out

    def _slots(self, parts: tuple[str, ...]) -> list[TensorSlot]:
        by_name = {s.local: s for s in self.layout}
        return [by_name[p] for p in parts if p in by_name]

    def _contiguous(self, parts: tuple[str, ...]):
        slots = self._slots(parts)
        if len(slots) != len(parts) or len({(s.dtype, s.shape[1:]) for s in slots}) != 1:
            return None
        if any(a.offset + a.nbytes != b.offset for a, b in itertools.pairwise(slots)):
            return None
        return slots[0], sum(s.shape[0] for s in slots)

    @property
    def host_views(self) -> dict[str, torch.Tensor]:
        return self._host_views

    def row_segments(self) -> list[tuple[int, int, int]]:
        """(first word, words, words a row) of each tensor in the buffer, each running to the next one's start
        (its padding included): how transfer coding cuts its chunks (`transfer_code.chunk_bounds`)."""
        ends = [s.offset for s in self.layout[1:]] + [self.nbytes]
        return [(s.offset // 2, (end - s.offset) // 2, s.shape[-1] if len(s.shape) > 1 else (end - s.offset) // 2)
                for s, end in zip(self.layout, ends)]


def _expert_stacks(layout: tuple[TensorSlot, ...]) -> list[tuple] | None:
    """How to cut stacked views from an expert group's buffer (see the module docstring); None for any
    other sub-layer. Each entry: (name, first byte, experts, bytes per expert, element offset within an
    expert's block, elements, shape of one, dtype)."""
    if not layout or not all(s.local.startswith("experts.") for s in layout):
        return None
    by_part: dict[str, list[TensorSlot]] = {}
    for s in layout:
        by_part.setdefault(s.local.split(".", 2)[2], []).append(s)
    n, first = len(layout) // len(by_part), layout[0]
    block = layout[len(by_part)].offset - first.offset if n > 1 else sum(
        -(-s.nbytes // _ALIGN) * _ALIGN for s in layout)
    stacks = []
    for part, slots in by_part.items():
        s = slots[0]
        el = s.dtype.itemsize
        if len(slots) != n or any(t.offset - s.offset != i * block for i, t in enumerate(slots)) or \
                (s.offset - first.offset) % el or block % el:
            raise ValueError(f"expert group laid out unevenly at {s.local}")
        numel = s.nbytes // el
        stacks.append((f"experts.{part.removesuffix('.weight')}.weight", first.offset, n, block,
                       (s.offset - first.offset) // el, numel, s.shape, s.dtype))
    gate, up = by_part.get("gate.weight"), by_part.get("up.weight")
    if gate and up and gate[0].offset + gate[0].nbytes == up[0].offset and gate[0].shape == up[0].shape:
        el = gate[0].dtype.itemsize
        stacks.append(("experts.gate_up.weight", first.offset, n, block, (gate[0].offset - first.offset) // el,
                       2 * gate[0].nbytes // el, (2 * gate[0].shape[0], *gate[0].shape[1:]), gate[0].dtype))
    return stacks


class Stages:
    """The staging ring of coded copies: buffers on the device; on CUDA, per buffer an event recorded when a
    piece has crossed into it and one when it has been decoded (free again); and the copy programs
    (`transfer_code.Program`) cut for it, which live as long as the ring and the slots."""

    def __init__(self, bufs: list[torch.Tensor]):
        self.bufs = bufs
        self._events = None
        self._programs: dict[tuple[int, int], Program] = {}

    def program(self, coded: CodedBuffer, dst: torch.Tensor, keep: bool = True) -> Program:
        """The copy program of `coded` into `dst`: cut once and kept where `keep` (a slot, copied into at
        every step), else cut for this copy alone."""
        key = (dst.data_ptr(), id(coded))
        prog = self._programs.get(key)
        if prog is None:
            prog = Program(coded, dst, self.bufs)
            if keep:
                self._programs[key] = prog
        return prog

    def events(self):
        """(arrived, done, used) per buffer; CUDA only."""
        if self._events is None:
            n = len(self.bufs)
            self._events = ([torch.cuda.Event() for _ in range(n)], [torch.cuda.Event() for _ in range(n)], [False] * n)
        return self._events

    def pending(self) -> list:
        """The events to wait for before the buffers are freed."""
        if self._events is None:
            return []
        _, done, used = self._events
        return [e for e, u in zip(done, used) if u]

    def close(self) -> None:
        self._programs.clear()


class WeightStore:
    """All sub-layers' host buffers, the resident VRAM copies, and the streaming slots."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]], accel: Accelerator | None,
                 transfer_code: bool = False):
        self.accel = accel
        pin = accel is not None and accel.kind == "cuda"
        bufs = host_buffers([packed_bytes(t) for t in groups.values()], pin)   # few pinned chunks, not one each
        self.sublayers = {name: SubLayerWeights(name, tensors, pin, buf)
                          for (name, tensors), buf in zip(groups.items(), bufs)}
        self.resident: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.slots: list[torch.Tensor] = []
        self.slot_bytes = 0
        self._slot_views: dict[tuple[int, str], dict[str, torch.Tensor]] = {}   # dropped with the slots
        self.coded: dict[str, CodedBuffer] = {}
        self._read_coded: list[torch.Tensor] = []      # raw matrices the CPU reads coded (SLIPSTREAM_CPU_CODED)
        self.stages: Stages | None = None
        if transfer_code and accel is not None:
            self.code_for_transfer(pin)

    def code_for_transfer(self, pin: bool) -> None:
        """Keep a transfer-coded copy of every bf16 sub-layer (but the embedding, gathered on the host) big
        enough to gain from it."""
        floor = min_bytes()
        layouts = {}
        for name, sw in self.sublayers.items():
            if name == "embed" or sw.nbytes < floor or any(s.dtype != torch.bfloat16 for s in sw.layout):
                continue
            layout = plan(sw.host, segments=sw.row_segments())
            if layout is not None:
                layouts[name] = layout
        bufs = host_buffers([coded_size(*lay[1:]) for lay in layouts.values()], pin)   # packed, as the raw ones
        for (name, layout), buf in zip(layouts.items(), bufs):
            self.coded[name] = encode_into(self.sublayers[name].host, layout, buf)
        if self.coded and self.accel.kind == "cuda":
            warm_up(self.accel.device)
        if self.coded and os.environ.get("SLIPSTREAM_CPU_CODED", "0") == "1":
            self._read_coded_on_cpu()

    # The matrices the native CPU calls can read coded, as (view, the tensor its rows start at), by the set that
    # one call needs whole: a dense FFN's, an attention's, a head's (untied or tied)
    _CPU_CODED = ((("gate_up.weight", "gate.weight"), ("down.weight", "down.weight")),
                  (("qkv.weight", "q.weight"), ("o.weight", "o.weight")),
                  (("head.weight", "head.weight"),), (("embed.weight", "embed.weight"),))

    def _read_coded_on_cpu(self) -> None:
        """Opt-in (`SLIPSTREAM_CPU_CODED=1`, for A/B runs; the estimator still prices raw bytes): the native
        CPU calls read coded sub-layers' matrices from the coded copy (`kernels.read_coded`) where this CPU
        can (AVX512-BF16): a dense FFN's gate_up and down, an attention's qkv and o, the head."""
        from engine import kernels

        if not kernels.coded_ready():
            return
        for name, coded in self.coded.items():
            sw = self.sublayers[name]
            slots = {x.local: x for x in sw.layout}
            for group in self._CPU_CODED:
                mats = []
                for key, first in group:
                    t, slot = sw.host_views.get(key), slots.get(first)
                    if t is None or slot is None or t.dim() != 2:
                        break
                    try:
                        mats.append((t, CpuMatrix(coded, slot.offset // 2, *t.shape)))
                    except ValueError:
                        break
                if len(mats) == len(group):
                    for t, mat in mats:
                        kernels.read_coded(t, mat)
                        self._read_coded.append(t)

    @property
    def stage_bytes(self) -> int:
        """One staging buffer's bytes (0 without coded sub-layers)."""
        return max((c.stage_bytes for c in self.coded.values()), default=0)

    @property
    def escape_index_bytes(self) -> int:
        """The int64 index PyTorch makes for one scatter of escapes (`apply_escapes`): a slice's at most."""
        return 8 * min(ESCAPE_SLICE, max((c.escapes for c in self.coded.values()), default=0))

    def transfer_bytes(self) -> dict[str, int]:
        """Bytes a whole streamed copy of each coded sub-layer moves."""
        return {n: c.nbytes for n, c in self.coded.items()}

    def nbytes(self, name: str) -> int:
        return self.sublayers[name].nbytes

    # ---- resident set --------------------------------------------------------------------------
    def evict(self, name: str) -> None:
        buf, _ = self.resident.pop(name)
        self.accel.free(buf, "weights")

    def _admit(self, name: str, after):
        """Give `name` a resident buffer and queue its copy there, after the compute event `after` (the
        buffer may reuse memory of one just evicted that queued compute still reads): transfer-coded
        through the staging ring where the sub-layer is coded and the ring is there. The copy's handle."""
        sw = self.sublayers[name]
        buf = self.accel.alloc(sw.nbytes, "weights", f"resident {name}")
        coded = self.coded.get(name)
        if coded is not None and self.stages is not None:
            handle = self.accel.copy_coded_async(buf, coded, self.stages, after=after, keep=False)
        else:
            handle = self.accel.copy_async(buf, sw.host, after=after)
        self.resident[name] = (buf, sw.views(buf))
        return handle

    def set_resident(self, names: set[str]) -> None:
        """Evict what is no longer resident first (so the budget can only shrink), then admit: each
        admission's buffer is allocated while the copies before it run, and all are waited for at the end
        (one after another, allocation and copy, six FFNs of the Llama-3-8B shape took 193 ms on the H200:
        session 24, call BJ0)."""
        for name in [n for n in self.resident if n not in names]:
            self.evict(name)
        pending, after = [], self.accel.compute_event()
        try:
            for name in sorted(names - self.resident.keys(), key=lambda n: self.sublayers[n].nbytes):
                pending.append(self._admit(name, after))
        finally:                      # (an allocation refused: the copies queued before it still finish)
            for handle in pending:
                handle.wait_host()

    # ---- slots ---------------------------------------------------------------------------------
    def set_slots(self, n_slots: int, slot_bytes: int) -> None:
        if n_slots == len(self.slots) and slot_bytes == self.slot_bytes:
            return
        self.drop_slots()
        self.slot_bytes = slot_bytes
        self.slots = [self.accel.alloc(slot_bytes, "slots", "streaming slot") for _ in range(n_slots)]
        if n_slots and self.coded:
            self.stages = Stages([self.accel.alloc(self.stage_bytes, "slots", "transfer staging buffer")
                                  for _ in range(N_STAGES)])
            self.accel.book(self.escape_index_bytes, "slots", "the index of a transfer's escapes")

    def slot_views(self, slot: int, name: str) -> dict[str, torch.Tensor]:
        """Views of sub-layer `name`'s tensors in streaming slot `slot`, cut once per slot and sub-layer
        (a streamed sub-layer comes back to the same slot every step)."""
        views = self._slot_views.get((slot, name))
        if views is None:
            views = self._slot_views[(slot, name)] = self.sublayers[name].views(self.slots[slot])
        return views

    def drop_slots(self) -> None:
        self._slot_views.clear()        # the views hold the slots' memory
        for buf in self.slots:
            self.accel.free(buf, "slots")
        self.slots, self.slot_bytes = [], 0
        if self.stages is not None:
            self.accel.issued()                 # (the issuer thread's last coded copy uses the ring)
            self.accel.wait_events(self.stages.pending())
            self.stages.close()
            for buf in self.stages.bufs:
                self.accel.free(buf, "slots")
            self.accel.unbook(self.escape_index_bytes, "slots")
            self.stages = None

    def close(self) -> None:
        if self._read_coded:
            from engine import kernels

            kernels.forget_coded(self._read_coded)
            self._read_coded = []
        if self.accel is not None:
            for name in list(self.resident):
                self.evict(name)
            self.drop_slots()
