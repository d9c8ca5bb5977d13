"""Where each sub-layer's weights live: one flat host buffer per sub-layer, plus VRAM copies.

Every sub-layer's tensors are packed into one contiguous host buffer (pinned on CUDA, so copies run at
full PCIe speed on the copy engine). A `resident` sub-layer also has a VRAM copy of that buffer; a
`streamed` one is copied into a slot before use; a `cpu` one is computed from the host buffer. Views
(name -> tensor) are cut from whichever buffer is used, so one copy moves a whole sub-layer.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.sharding.device import Accelerator

_ALIGN = 256
_FUSED = {"qkv.weight": ("q.weight", "k.weight", "v.weight"), "qkv.bias": ("q.bias", "k.bias", "v.bias"),
          "gate_up.weight": ("gate.weight", "up.weight")}


@dataclass(frozen=True, slots=True)
class TensorSlot:
    local: str                  # name inside the sub-layer, e.g. "q.weight"
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class SubLayerWeights:
    """The packed host buffer of one sub-layer and its layout."""

    def __init__(self, name: str, tensors: dict[str, torch.Tensor], pin: bool):
        self.name = name
        layout, off = [], 0
        for local, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            layout.append(TensorSlot(local, off, nbytes, tuple(t.shape), t.dtype))
            off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        self.layout = tuple(layout)
        self.nbytes = off
        buf = torch.empty(off, dtype=torch.uint8, pin_memory=pin)
        for s, t in zip(layout, tensors.values()):
            buf[s.offset:s.offset + s.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        self.host = buf
        self._host_views = self.views(buf)

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
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


class WeightStore:
    """All sub-layers' host buffers, the resident VRAM copies, and the streaming slots."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]], accel: Accelerator | None):
        self.accel = accel
        pin = accel is not None and accel.kind == "cuda"
        self.sublayers = {name: SubLayerWeights(name, tensors, pin) for name, tensors in groups.items()}
        self.resident: dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.slots: list[torch.Tensor] = []
        self.slot_bytes = 0

    def nbytes(self, name: str) -> int:
        return self.sublayers[name].nbytes

    # ---- resident set --------------------------------------------------------------------------
    def evict(self, name: str) -> None:
        buf, _ = self.resident.pop(name)
        self.accel.free(buf, "weights")

    def admit(self, name: str) -> None:
        sw = self.sublayers[name]
        buf = self.accel.alloc(sw.nbytes, "weights", f"resident {name}")
        self.accel.copy_async(buf, sw.host).wait_host()
        self.resident[name] = (buf, sw.views(buf))

    def set_resident(self, names: set[str]) -> None:
        """Evict what is no longer resident first (so the budget can only shrink), then admit."""
        for name in [n for n in self.resident if n not in names]:
            self.evict(name)
        for name in sorted(names - self.resident.keys(), key=lambda n: self.sublayers[n].nbytes):
            self.admit(name)

    # ---- slots ---------------------------------------------------------------------------------
    def set_slots(self, n_slots: int, slot_bytes: int) -> None:
        if n_slots == len(self.slots) and slot_bytes == self.slot_bytes:
            return
        self.drop_slots()
        self.slot_bytes = slot_bytes
        self.slots = [self.accel.alloc(slot_bytes, "slots", "streaming slot") for _ in range(n_slots)]

    def drop_slots(self) -> None:
        for buf in self.slots:
            self.accel.free(buf, "slots")
        self.slots, self.slot_bytes = [], 0

    def close(self) -> None:
        if self.accel is not None:
            for name in list(self.resident):
                self.evict(name)
            self.drop_slots()
