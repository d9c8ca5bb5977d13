"""Plans: where every sub-layer lives and runs, for one token tier and one budget.

A `Plan` maps each sub-layer name (see `engine.sharding.spec`) to a `Placement`. A `PlanSet` holds one
plan per token tier; all its plans share one resident set where the planner could arrange it, so that
switching tiers copies little. The executor runs whatever plan it is given; the planner chooses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

PLAN_KINDS = ("gpu_only", "static", "dynamic")
DEFAULT_TIERS = (1, 4, 16, 64, 256, 1024, 4096)


class Placement(str, Enum):
    RESIDENT = "resident"   # weights in VRAM for good
    STREAMED = "streamed"   # weights in pinned host memory, copied into a VRAM slot just before use
    CPU = "cpu"             # computed on the CPU from host memory

    def __str__(self) -> str:  # "resident", not "Placement.RESIDENT"
        return self.value


@dataclass(slots=True)
class VramBreakdown:
    weights: int = 0   # resident weights
    kv: int = 0        # KV cache of the sub-layers whose attention runs on the GPU
    slots: int = 0     # streaming slots (n_slots x largest streamed sub-layer)
    scratch: int = 0   # activations and workspace for the tier, with the margin

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.slots + self.scratch

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "slots": self.slots, "scratch": self.scratch,
                "total": self.total}


@dataclass(slots=True)
class Plan:
    tier: int                         # the largest number of new tokens per step this plan serves
    kind: str                         # "gpu_only" | "static" | "dynamic" | "manual"
    placement: dict[str, Placement]   # sub-layer name -> placement
    n_slots: int = 2                  # streaming slots (2 = double-buffered)
    predicted_ms: float = float("nan")
    vram: VramBreakdown = field(default_factory=VramBreakdown)
    kv_tokens: int = 0                # KV capacity (tokens) on the GPU this plan assumes
    # The first kv_layers layers keep their KV cache on the GPU, the others in host memory; an attention of
    # a later layer placed on the GPU (streamed) copies its layer's KV in for the step and its new keys
    # and values back out. None: each layer's KV lives where its attention runs.
    kv_layers: int | None = None
    # Of each streamed dense FFN's intermediate rows, how many (the last ones) the CPU computes from the
    # host copy while the GPU computes the rest from its slot, which receives only those rows of gate and
    # up (with the whole down projection): the copy shrinks by their bytes and the CPU takes them in each
    # layer, where a whole FFN moved to the CPU would unbalance the steps around it. 0: none.
    ffn_cpu_rows: int = 0

    def kv_on_gpu(self, layer: int) -> bool:
        """Whether layer `layer`'s KV cache lives in VRAM under this plan."""
        if self.kv_layers is not None:
            return layer < self.kv_layers
        return self.placement[f"layers.{layer}.attn"] is not Placement.CPU

    def host_kv_attention(self, layer: int) -> bool:
        """Attention on the GPU over a KV cache kept in host memory."""
        return self.placement[f"layers.{layer}.attn"] is not Placement.CPU and not self.kv_on_gpu(layer)

    def resident(self) -> list[str]:
        return [n for n, p in self.placement.items() if p is Placement.RESIDENT]

    def streamed(self) -> list[str]:
        return [n for n, p in self.placement.items() if p is Placement.STREAMED]

    def on_gpu(self, name: str) -> bool:
        return self.placement[name] is not Placement.CPU

    def report(self) -> dict:
        rep = {"tokens": self.tier, "plan": self.kind, "predicted_ms": self.predicted_ms,
               "vram": self.vram.as_dict(), "placement": {k: str(v) for k, v in self.placement.items()},
               "n_slots": self.n_slots}
        if self.kv_layers is not None:
            rep["kv_layers"] = self.kv_layers
        if self.ffn_cpu_rows:
            rep["ffn_cpu_rows"] = self.ffn_cpu_rows
        return rep


@dataclass(slots=True)
class PlanSet:
    budget: int
    plans: list[Plan]                 # sorted by tier
    # Inputs longer than this run fastest as steps of this many tokens (the tier with the lowest predicted
    # time per token); 0 = no advice (run in steps of the largest tier).
    step_tokens: int = 0

    def for_tokens(self, n_new: int) -> Plan:
        """The plan of the smallest tier that holds `n_new` new tokens (the largest tier past the end)."""
        for p in self.plans:
            if p.tier >= n_new:
                return p
        return self.plans[-1]

    def report(self) -> dict:
        return {"budget": self.budget, "step_tokens": self.step_tokens or self.plans[-1].tier,
                "tiers": [p.report() for p in self.plans]}
