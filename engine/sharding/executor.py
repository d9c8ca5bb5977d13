"""Runs a transformer step sub-layer by sub-layer under a plan.

Each sub-layer runs where its plan puts it: `resident` from its VRAM copy, `streamed` from a slot that the
copy engine filled ahead of time (double-buffered: while one slot is computed on, the next streamed
sub-layer is copied into the other; prefetch carries across steps; a plan of one slot, as a decode plan may
be, copies the next sub-layer once the slot's compute is done), `cpu` from host memory. Activations
cross between CPU and GPU only where consecutive sub-layers sit on different sides. The KV cache of a
layer lives where that layer's attention runs. In a mixture-of-experts layer the router (`ffn`) and each
expert group run where each is placed, the `MoeState` between them crossing sides like the hidden state;
a one-token step on the GPU runs a layer whose router and groups are all resident as one call that reads
nothing back to the host (`moe.layer_few_tokens`, from a CUDA graph where graphs are on).

Routed expert streaming: in steps that touch few experts (`spec.routed_streaming`: decode, short steps) a
streamed expert group is not copied whole ahead of time. Its load waits in a queue until its layer's
router has run (the per-expert counts reach the host through a non-spinning wait), then only the routed
experts' bytes are copied, into their places in the slot (the group's buffer is packed expert by
expert, so the slot's stacked views stay valid for them; experts not copied are never read). The copies
of all the layer's groups that hold slots start at once and overlap the compute of the groups before
them. A slot remembers which experts it holds, so a group that keeps its slot tops up only missing ones.

`activate(plan)` brings memory to the plan's state, releasing before admitting so that usage never
exceeds the larger of the old and new budgets; a `between_sublayers` hook lets the engine re-plan
mid-step (a budget drop never waits for a long prefill to finish).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import ModelConfig, weight_names
from engine.models import dense, moe
from engine.models.rope import RotaryTable
from engine.sharding import graphs
from engine.sharding.device import Accelerator
from engine.sharding.kvcache import BLOCK_SIZE, PagedKVCache, Sequence
from engine.sharding.memory import HEAD_ROWS_MAX as HEAD_ROWS
from engine.sharding.memory import TENSOR_ALIGN as ALIGN
from engine.sharding.memory import head_rows_at_once
from engine.sharding.plan import Placement, Plan
from engine.sharding.spec import routed_streaming


@dataclass(slots=True)
class StepItem:
    """One sequence's part of a step: its new tokens, and optionally every new token's logits, explicit
    rotary positions ([n] or [3, n]) and image embedding rows (bool mask [n], rows [k, hidden])."""
    seq: Sequence
    ids: list[int]
    all_logits: bool = False
    positions: torch.Tensor | None = None
    embeds: tuple | None = None


@dataclass(slots=True, eq=False)
class _Segment:
    """Where a sequence's tokens sit in a batched step."""
    seq: Sequence
    start: int            # cache index of its first new token
    row: int              # its first row in the step's activations
    n: int
    masks: dict           # attention mask per device


@dataclass(slots=True)
class _DecodeGroup:
    """The sequences of a step that decode one token with nothing masked: their attention runs as one
    call over their padded caches. rows: their rows in the step's activations, per device."""
    segs: list[_Segment]
    rows: dict

    @staticmethod
    def of(segs: list[_Segment], gpu) -> _DecodeGroup | None:
        decode = [s for s in segs if s.n == 1 and s.masks[torch.device("cpu")] is None]
        if len(decode) < 2:
            return None
        rows = {torch.device("cpu"): torch.tensor([s.row for s in decode])}
        if gpu is not None:
            rows[gpu] = rows[torch.device("cpu")].to(gpu)
        return _DecodeGroup(decode, rows)


def _attend_padded(q, keys, values, valid, gqa: bool) -> torch.Tensor:
    """q [B, heads, 1, head_dim] against keys/values [B, kv_heads, L, head_dim] where valid [B, L]."""
    if gqa and q.device.type == "cuda":   # the masked kernel takes no grouped heads: expand them
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        gqa = False
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :], enable_gqa=gqa)


class Executor:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], accel: Accelerator | None,
                 dtype: torch.dtype, kv_fp8: bool = False, transfer_code: bool = False):
        self.cfg = cfg
        self.accel = accel
        self.dtype = dtype
        groups = {}
        for sub, names in weight_names(cfg).items():
            groups[sub] = {n.split(".", 2)[-1] if n.startswith("layers.") else n: weights[n] for n in names}
        from engine.sharding.weights import WeightStore

        self.store = WeightStore(groups, accel, transfer_code)
        self.order = list(groups)                   # embed, layers.0.attn, layers.0.ffn, ..., head
        self._next = dict(zip(self.order, self.order[1:]))   # sub-layer -> the one after it
        self.kv = PagedKVCache(cfg, dtype, accel, fp8=kv_fp8)
        self.rope = RotaryTable(cfg)
        # one-token GPU work replayed from CUDA graphs (see graphs.py); None off CUDA or when turned off
        self.graphs = (graphs.OneTokenGraphs(accel)
                       if accel is not None and accel.kind == "cuda" and graphs.enabled() else None)
        self.plan: Plan | None = None
        self.scratch_booked = 0
        self.slot_content: list[str | None] = []
        self.slot_ready: list = []                  # CopyHandle per slot (or None)
        self.slot_free_after: list = []             # compute event after the slot's last use
        self.between_sublayers: Callable[[], bool] | None = None
        self.copied_bytes = 0                       # weight bytes streamed so far (stats)
        self.label_sublayers = False                # name each sub-layer in profiler traces
        # When a dict: host seconds of each sub-layer (its start to the next one's, so a crossing's copy
        # and wait count where they happen: in the sub-layer that needs the moved input), summed per
        # "placement/kind" as [count, seconds] (`engine.bench.host_costs`; no profiler, no overhead)
        self.sublayer_times: dict[str, list] | None = None
        # MoE sub-layers: router name -> None; expert group name -> (its experts, last group of its layer)
        self.moe_steps: dict[str, tuple[range, bool] | None] = {}
        self._moe_layer: dict[str, int] = {}         # MoE sub-layer -> its layer
        self._later_groups: dict[str, list[str]] = {}   # expert group -> the groups after it in its layer
        self._later_groups_of_router: dict[str, list[str]] = {}   # router -> its layer's groups
        # A step of up to moe.FEW_TOKENS tokens runs a MoE layer held in VRAM whole as one GPU call
        # (`moe.layer_few_tokens`);
        # False (or SLIPSTREAM_MOE_LAYER_CALL=0, for A/B runs): the router and the groups one by one
        self.fused_moe = os.environ.get("SLIPSTREAM_MOE_LAYER_CALL", "1") != "0"
        # a step's MoE layer all on the CPU as one native call, up to 16 tokens (`moe.layer_cpu`; 0: A/B runs)
        self.cpu_moe_layer = os.environ.get("SLIPSTREAM_MOE_CPU_LAYER", "1") != "0"
        self._cpu_tables: dict[str, tuple] = {}   # router -> (plan, its groups, their weights, expert table)
        # a one-token attention on the CPU as one native call (`kernels.attention_decode`; 0: A/B runs)
        self.cpu_attention_call = os.environ.get("SLIPSTREAM_CPU_ATTENTION_CALL", "1") != "0"
        # a batch's decode tokens through one such call (`kernels.attention_decode_many`; 0: A/B runs)
        self.cpu_attention_batch = os.environ.get("SLIPSTREAM_CPU_ATTENTION_BATCH", "1") != "0"
        # A GPU expert group in a step of more than moe.FEW_TOKENS tokens runs in padded runs
        # (`moe.experts_padded`); False (SLIPSTREAM_MOE_PADDED=0, for A/B runs): one expert at a time
        self.padded_moe = os.environ.get("SLIPSTREAM_MOE_PADDED", "1") != "0"
        # a one-token attention captured whole, cache write included (see graphs.attention_enabled)
        self.graph_attention = graphs.attention_enabled()
        # ... run from the host where its neighbours run there (`graphs.host_io_enabled`)
        self.graph_host_io = graphs.host_io_enabled()
        for i in range(cfg.num_layers):
            if cfg.is_moe_layer(i):
                self.moe_steps[f"layers.{i}.ffn"] = None
                self._moe_layer[f"layers.{i}.ffn"] = i
                groups_i = cfg.expert_groups()
                names = [f"layers.{i}.experts.{g}" for g in range(len(groups_i))]
                for g, experts in enumerate(groups_i):
                    self.moe_steps[names[g]] = (experts, g == len(groups_i) - 1)
                    self._moe_layer[names[g]] = i
                    self._later_groups[names[g]] = names[g + 1:]
                self._later_groups_of_router[f"layers.{i}.ffn"] = names
        # Routed expert streaming (see the module docstring): None = in the steps `routed_streaming`
        # picks, True = in every step (tests), False = never (streamed groups are copied whole).
        self.routed_experts: bool | None = None
        self.routed_loads = 0                       # group loads that copied routed experts only (stats)
        self._routed_now = False                    # this step copies routed experts only
        self._routing: dict[int, list[int]] = {}    # layer -> its router's expert bounds, this step
        self._pending: list[tuple[int, str]] = []   # (slot, sub-layer) loads not issued yet, in order
        self.slot_valid: list = []                  # per slot: True (all of it), or the set of experts held
        # per slot: of a dense FFN's gate and up rows, how many at the end its copy left out (the CPU's share,
        # `Plan.ffn_cpu_rows`); a slot valid for a share holds every row a larger share needs
        self.slot_skip: list[int] = []
        self._dense_ffn = {f"layers.{i}.ffn" for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)}
        # a streamed dense FFN's rows split with the CPU as the plan says (its ffn_cpu_rows); False: whole FFNs
        self.ffn_share = True
        self._spans: dict[str, dict[int, tuple[int, int]]] = {}   # group -> expert -> its byte range

    # ---- memory state --------------------------------------------------------------------------
    @torch.inference_mode()
    def activate(self, plan: Plan, kv_blocks: int | None = None) -> None:
        """Bring resident weights, slots, KV placement and scratch booking to `plan`'s state."""
        if self.accel is None:
            if any(p is not Placement.CPU for p in plan.placement.values()):
                raise ValueError("a plan with GPU placements needs an accelerator")
            self.plan = plan
            return
        accel, store = self.accel, self.store
        if self.graphs is not None:       # (weights move; and their booking must not stand in the plan's way)
            self.graphs.clear()
        streamed = plan.streamed()
        slot_bytes = max((store.nbytes(n) for n in streamed), default=0)
        n_slots = min(plan.n_slots, len(streamed)) if streamed else 0
        resident = set(plan.resident())
        kv_gpu = [plan.kv_on_gpu(i) for i in range(self.cfg.num_layers)]
        # 1. Release: scratch, slots that change, weights leaving, KV leaving the GPU.
        accel.unbook(self.scratch_booked, "scratch")
        self.scratch_booked = 0
        if (n_slots, slot_bytes) != (len(store.slots), store.slot_bytes):
            self._drain_slots()
            store.drop_slots()
        for name in [n for n in store.resident if n not in resident]:
            store.evict(name)
        for i, on_gpu in enumerate(kv_gpu):
            if not on_gpu:
                self.kv.place_layer(i, False)
        # 2. Admit: KV arriving on the GPU, slots, weights, scratch.
        if kv_blocks is not None and kv_blocks > self.kv.n_blocks:
            self.kv._grow(kv_blocks)
        for i, on_gpu in enumerate(kv_gpu):
            if on_gpu:
                self.kv.place_layer(i, True)
        if n_slots and not store.slots:
            store.set_slots(n_slots, slot_bytes)
            self.slot_content = [None] * n_slots
            self.slot_ready = [None] * n_slots
            self.slot_free_after = [None] * n_slots
            self.slot_valid = [set() for _ in range(n_slots)]
            self.slot_skip = [0] * n_slots
        store.set_resident(resident)
        scratch = plan.vram.scratch
        accel.book(scratch, "scratch", f"scratch for {plan.tier}-token steps")
        self.scratch_booked = scratch
        self.plan = plan

    def _drain_slots(self) -> None:
        """Wait for every slot's copy before the slots go. A copy that ran out of memory is not raised again
        here (its step raised it, or the slot's content is dropped now); the device is synchronized instead,
        since a copy that stopped half-way leaves no event to wait for."""
        failed = False
        for h in self.slot_ready:
            if h is not None:
                try:
                    h.wait_host()
                except torch.OutOfMemoryError:
                    failed = True
        if failed:
            self.accel.synchronize()
        self.slot_content, self.slot_ready, self.slot_free_after = [], [], []
        self.slot_valid, self.slot_skip, self._pending = [], [], []

    def release_to_driver(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        if self.accel is not None:
            self.accel.release_to_driver()

    # ---- streaming -----------------------------------------------------------------------------
    def _streamed_order(self) -> list[str]:
        return [n for n in self.order if self.plan.placement[n] is Placement.STREAMED]

    def _load(self, slot: int, name: str) -> None:
        """Give `slot` to `name` and queue its copy (issued now unless it waits for a router)."""
        if self.slot_content[slot] != name:
            self.slot_content[slot] = name
            self.slot_valid[slot] = set()
            self.slot_skip[slot] = 0
        self._pending.append((slot, name))
        self._pump()

    def _pump(self) -> None:
        """Issue queued loads in order, up to the first routed expert group whose router has not run."""
        while self._pending:
            slot, name = self._pending[0]
            # (a load the plan no longer streams, or whose slot went to another, is dropped)
            if self.slot_content[slot] == name and self.plan.placement.get(name) is Placement.STREAMED:
                experts = self._routed_experts(name)
                if experts is False:
                    return
                self._issue(slot, name, experts)
            self._pending.pop(0)

    def _routed_experts(self, name: str):
        """The experts of `name` to copy this step: None = the whole sub-layer, False = not known yet
        (its router has not run), else the routed experts of the group."""
        step = self.moe_steps.get(name)
        if step is None or not self._routed_now:
            return None
        bounds = self._routing.get(int(name.split(".")[1]))
        if bounds is None:
            return False
        return [e for e in step[0] if bounds[e + 1] > bounds[e]]

    def _issue(self, slot: int, name: str, experts: list[int] | None) -> None:
        """Copy `name` (or only `experts` of it) into `slot`, skipping what the slot already holds."""
        valid = self.slot_valid[slot]
        skip = self.ffn_skip(name)
        if valid is True and self.slot_skip[slot] <= skip:
            return
        sw = self.store.sublayers[name]
        buf = self.store.slots[slot]
        coded = self.store.coded.get(name) if experts is None and not skip else None
        if coded is not None and self.store.stages is not None:   # the coded bytes, decoded on the GPU
            self.slot_ready[slot] = self.accel.copy_coded_async(buf, coded, self.store.stages,
                                                                after=self.slot_free_after[slot])
            self.copied_bytes += coded.nbytes
            self.slot_valid[slot] = True
            self.slot_skip[slot] = 0
            return
        if experts is None:
            runs = self._share_runs(name, skip) if skip else [(0, sw.nbytes)]
        else:
            runs = self._expert_runs(name, [e for e in experts if e not in valid])
        for a, b in runs:
            self.slot_ready[slot] = self.accel.copy_async(buf[a:b], sw.host[a:b], after=self.slot_free_after[slot])
            self.copied_bytes += b - a
        if experts is None:
            self.slot_valid[slot] = True
            self.slot_skip[slot] = skip
        else:
            valid.update(experts)
            self.routed_loads += 1

    def ffn_skip(self, name: str) -> int:
        """How many of dense FFN `name`'s last intermediate rows the CPU computes under the plan (its CPU share;
        0 unless it streams)."""
        rows = self.plan.ffn_cpu_rows if self.plan is not None and self.ffn_share else 0
        if not rows or name not in self._dense_ffn or self.plan.placement[name] is not Placement.STREAMED:
            return 0
        return rows

    def _share_runs(self, name: str, skip: int) -> list[tuple[int, int]]:
        """Byte ranges of dense FFN `name`'s packed buffer its slot needs when the CPU computes the last
        `skip` intermediate rows: all but those rows of gate and up (neighbours merged)."""
        out: list[tuple[int, int]] = []
        for t in self.store.sublayers[name].layout:
            end = -(-(t.offset + t.nbytes) // ALIGN) * ALIGN
            if t.local in ("gate.weight", "up.weight"):
                end = t.offset + (t.shape[0] - min(skip, t.shape[0])) * (t.nbytes // t.shape[0])
            if end <= t.offset:
                continue
            if out and out[-1][1] == t.offset:
                out[-1] = (out[-1][0], end)
            else:
                out.append((t.offset, end))
        return out

    def _ffn_shared(self, name: str, w, x: torch.Tensor, x_in: torch.Tensor, skip: int) -> torch.Tensor:
        """Streamed dense FFN `name` with its last `skip` intermediate rows on the CPU: the GPU's part (from the
        slot, which holds the other rows of gate and up) is queued first, then the host computes its rows from
        the host copy (`x_in`, the hidden state before it crossed) while the copy engine and the GPU work;
        their output crosses over and the down projection over all the rows runs on the GPU. Rounded as
        `dense.ffn_block` rounds."""
        cfg = self.cfg
        inter = w["down.weight"].shape[1]
        keep = inter - skip
        mine = dense.ffn_hidden(cfg, w, x, 0, keep) if keep else None
        host = x_in if x_in.device.type == "cpu" else self._move(x_in, False)
        theirs = self._move(dense.ffn_hidden(cfg, self.store.sublayers[name].host_views, host, keep, inter), True)
        act = theirs if mine is None else torch.cat([mine, theirs], -1)
        return x + dense.linear(act, w["down.weight"])

    def _expert_runs(self, name: str, experts: list[int]) -> list[tuple[int, int]]:
        """Byte ranges of group `name`'s packed buffer holding `experts` (global ids), neighbours merged."""
        spans = self._spans.get(name)
        if spans is None:   # expert e: from its first tensor to the aligned end of its last
            spans = {}
            for t in self.store.sublayers[name].layout:
                e = int(t.local.split(".")[1])
                a, b = spans.get(e, (t.offset, 0))
                spans[e] = (min(a, t.offset), max(b, -(-(t.offset + t.nbytes) // ALIGN) * ALIGN))
            self._spans[name] = spans
        out: list[tuple[int, int]] = []
        for e in sorted(experts):
            a, b = spans[e]
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
        return out

    def _routed_ready(self, layer: int) -> None:
        """The router of `layer` has run: issue its groups' queued loads and top up the routed experts
        of its groups that already hold a slot."""
        self._pump()
        prefix = f"layers.{layer}.experts."
        for slot, name in enumerate(self.slot_content):
            if name is not None and name.startswith(prefix):
                if (slot, name) in self._pending:        # behind a load that waits for a later router
                    self._pending.remove((slot, name))
                self._issue(slot, name, self._routed_experts(name))

    def _prime(self, streamed: list[str]) -> None:
        """Make sure the first streamed sub-layers are in (or on their way to) the slots."""
        want = streamed[:len(self.store.slots)]
        free = [s for s, c in enumerate(self.slot_content) if c not in want]
        for name in want:
            if name not in self.slot_content:
                self._load(free.pop(0), name)

    def _after_streamed(self, name: str, streamed: list[str]) -> None:
        """The slot holding `name` is free once this compute ends: fill it with the next in line."""
        slot = self.slot_content.index(name)
        self.slot_free_after[slot] = self.accel.compute_event()
        n = len(streamed)
        if n <= len(self.store.slots):
            return  # every streamed sub-layer has a slot of its own: nothing to cycle
        nxt = streamed[(streamed.index(name) + len(self.store.slots)) % n]
        if nxt not in self.slot_content:
            self._load(slot, nxt)

    def _weights(self, name: str) -> dict[str, torch.Tensor]:
        p = self.plan.placement[name]
        if p is Placement.RESIDENT:
            return self.store.resident[name][1]
        if p is Placement.STREAMED:
            slot = self.slot_content.index(name)
            if (slot, name) in self._pending:          # queued behind a load that waits: issue it now
                self._pending.remove((slot, name))
            experts = self._routed_experts(name)
            self._issue(slot, name, None if experts is False else experts)   # copies only what is missing
            if self.slot_ready[slot] is not None:      # None: nothing copied yet (no expert routed)
                self._wait_slot(slot)
            return self.store.slot_views(slot, name)
        return self.store.sublayers[name].host_views

    def _wait_slot(self, slot: int) -> None:
        """The compute waits for `slot`'s copy. A copy that failed (out of memory in the issuer thread, where
        a coded copy's decode allocates) empties the slot before its error goes up, so the step's retry
        copies it again instead of meeting the same failed copy at every wait (session 29, call CG: the MoE
        shape's 2 GiB row gave up with "out of memory even with nothing on the GPU", every back-off
        re-raising one escape scatter's error)."""
        try:
            self.slot_ready[slot].wait_compute()
        except BaseException:
            self.slot_content[slot] = None
            self.slot_ready[slot] = None
            self.slot_valid[slot] = set()
            self.slot_skip[slot] = 0
            raise

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, seq: Sequence, ids: list[int], all_logits: bool = False,
                positions: torch.Tensor | None = None, embeds=None) -> torch.Tensor:
        """Run `ids` (new tokens of `seq`) through the model; return float32 CPU logits for the last
        token, or for every new token with `all_logits`. The KV cache grows by len(ids) tokens.

        positions: rotary positions ([n], or [3, n] for M-RoPE); default cache index + seq.rope_delta.
        embeds: (bool mask [n], rows [k, hidden]) replacing the embeddings of the masked tokens (images).
        """
        return self.forward_batch([StepItem(seq, ids, all_logits, positions, embeds)])[0]

    @torch.inference_mode()
    def forward_batch(self, items: list[StepItem]) -> list[torch.Tensor]:
        """One step over several sequences, each with its own new tokens (a decode token or a prefill
        chunk). Embedding, projections, FFNs, experts and head run once over all the step's tokens (the
        weights are read, or streamed, once per step); attention runs per sequence against its own KV
        cache, positions and mask. Returns each item's logits as `forward` does."""
        cfg = self.cfg
        cpu = torch.device("cpu")
        gpu = self.accel.device if self.accel is not None and self.accel.kind == "cuda" else None
        segs, cos, sin, row = [], [], [], 0
        for it in items:
            n, start = len(it.ids), it.seq.length
            if n == 0:
                raise ValueError("a step item needs at least one new token")
            self.kv.reserve(it.seq, n)
            pos = it.positions
            if pos is None:
                pos = torch.arange(start, start + n) + it.seq.rope_delta
            c, s_ = self.rope.cos_sin(pos, cpu, self.dtype)
            cos.append(c)
            sin.append(s_)
            mask = dense.attention_mask(n, start, cfg.sliding_window, "cpu")
            masks = {cpu: mask}
            if gpu is not None:
                masks[gpu] = mask.to(gpu) if isinstance(mask, torch.Tensor) else mask
            segs.append(_Segment(it.seq, start, row, n, masks))
            row += n
        cos_sin = {cpu: (torch.cat(cos), torch.cat(sin)) if len(items) > 1 else (cos[0], sin[0])}
        decode = _DecodeGroup.of(segs, gpu)
        if gpu is not None:
            cos_sin[gpu] = tuple(t.to(gpu) for t in cos_sin[cpu])
        x = torch.tensor([t for it in items for t in it.ids], dtype=torch.long)
        image_rows = [(seg.row, it.embeds) for seg, it in zip(segs, items) if it.embeds is not None]
        # Rows the head computes: every row of an item that wants all logits, else its last row.
        head_rows = [r for seg, it in zip(segs, items)
                     for r in (range(seg.row, seg.row + seg.n) if it.all_logits else (seg.row + seg.n - 1,))]
        streamed = self._streamed_order() if self.accel is not None else []
        self._routing.clear()
        self._routed_now = cfg.is_moe and (routed_streaming(cfg, row) if self.routed_experts is None
                                           else self.routed_experts)
        if streamed:
            self._pump()        # loads queued by the last step wait for routers only in routed steps
            self._prime(streamed)
        fused: set[str] = set()       # expert groups already run together with an earlier group of their layer
        label = None
        times, last, t_last = self.sublayer_times, None, 0.0
        for name in self.order:
            if name in fused:
                continue
            if times is not None:
                t_last, last = _tally(times, last, t_last, self._time_key(name))
            if self.label_sublayers:           # a profiler range per sub-layer (benchmarks' traces)
                if label is not None:
                    label.__exit__(None, None, None)
                label = torch.profiler.record_function(f"{name}:{self.plan.placement[name].value}")
                label.__enter__()
            if self.between_sublayers is not None and self.between_sublayers():
                streamed = self._streamed_order()
                here = self.order.index(name)
                if streamed:
                    self._prime([s for s in streamed if self.order.index(s) >= here])
            on_gpu = self.plan.placement[name] is not Placement.CPU
            if (on_gpu and self.graphs is not None and self.graph_host_io and x.device.type == "cpu"
                    and name.endswith(".attn") and gpu is not None
                    and (y := self._attention_from_host(name, x, segs, cos_sin[gpu])) is not None):
                x = y             # (a captured attention between host sub-layers: its input and output
                continue          # crossed through the graph's pinned twins)
            x_in = x
            x = self._move(x, on_gpu)
            w = self._weights(name)
            dev = x.device
            if name == "embed":
                x = dense.embed_tokens(w, x, self.dtype)
                for at, (mask, rows) in image_rows:
                    part = x[at:at + mask.shape[0]]
                    part[mask.to(x.device)] = rows.to(device=x.device, dtype=x.dtype)
            elif name == "head":
                at_once = (head_rows_at_once(cfg, x.element_size(), x.shape[0]) if x.is_cuda or (
                    self.accel is not None and self.accel.kind == "sim" and on_gpu) else HEAD_ROWS)
                if len(head_rows) == 1:
                    x = x[head_rows[0]:head_rows[0] + 1]
                elif len(head_rows) < x.shape[0]:
                    x = x[torch.tensor(head_rows, device=dev)]
                x = self._head(w, x, at_once)
            elif name.endswith(".attn"):
                layer = int(name.split(".")[1])
                x = self._attention(layer, w, x, segs, decode, cos_sin[dev], dev)
            elif name not in self.moe_steps:
                if skip := self.ffn_skip(name):
                    x = self._ffn_shared(name, w, x, x_in, skip)
                elif self.graphs is not None and self.graphs.applies(x):
                    x = self.graphs.run("ffn", lambda w_, x_: dense.ffn_block(cfg, w_, x_), w, x).clone()
                else:
                    x = dense.ffn_block(cfg, w, x)
            elif self.moe_steps[name] is not None and not on_gpu:
                x = self._cpu_groups(name, w, x, fused)
            elif (groups := self._layer_in_vram(name, x)) is not None:
                x = self._moe_layer_on_gpu(name, w, groups, x, fused)
            elif (y := self._moe_layer_on_cpu(name, w, x, fused)) is not None:
                x = y
            else:
                x = self._moe_step(name, self.moe_steps[name], w, x)
            if streamed and self.plan.placement[name] is Placement.STREAMED:
                self._after_streamed(name, streamed)
        if label is not None:
            label.__exit__(None, None, None)
        if times is not None:
            _tally(times, last, t_last, None)
        for seg, it in zip(segs, items):
            seg.seq.length = seg.start + seg.n
            seg.seq.token_ids.extend(it.ids)
        logits = self._move(x, False)
        out, at = [], 0
        for seg, it in zip(segs, items):
            k = seg.n if it.all_logits else 1
            out.append(logits[at:at + k])
            at += k
        return out

    def _time_key(self, name: str) -> str:
        """`layers.3.ffn` placed on the CPU -> `cpu/ffn` (`cpu/router` for a MoE router, `cpu/experts`
        for expert groups run together)."""
        kind = "experts" if ".experts." in name else (
            "router" if name in self.moe_steps and self.moe_steps[name] is None else name.rsplit(".", 1)[-1])
        return f"{self.plan.placement[name].value}/{kind}"

    def _moe_step(self, name: str, step: tuple[range, bool] | None, w, x):
        layer = self._moe_layer[name]
        if step is None:   # the router: its per-expert counts go to the host (a non-spinning wait on CUDA)
            if x.device.type == "cuda":   # (the state comes back with them where the first group runs on the CPU)
                host = self.plan.placement[f"layers.{layer}.experts.0"] is Placement.CPU
                s = moe.router_block(self.cfg, w, x, self._wait_gpu, host=host)
            else:
                s = moe.router_block(self.cfg, w, x)
            self._routing[layer] = s.bounds
            if self._routed_now and self.slot_content:
                self._routed_ready(layer)
            return s
        experts, last = step
        if self.padded_moe and x.h.shape[0] > moe.FEW_TOKENS and not self._routed_now:   # (whole group)
            x = moe.experts_padded(self.cfg, w, x, experts)
        else:
            x = moe.experts_block(self.cfg, w, x, experts)
        if last:
            self._routing.pop(layer, None)
            return moe.finish(x)
        return x

    def _layer_in_vram(self, name: str, x: torch.Tensor) -> list[str] | None:
        """The expert groups of router `name`'s layer where the whole layer can run as one GPU call for
        this step of a few tokens (`moe.layer_few_tokens`): the router and every group resident; else None."""
        if not (self.fused_moe and self.moe_steps.get(name, 0) is None and x.shape[0] <= moe.FEW_TOKENS
                and (x.is_cuda or (self.accel is not None and self.accel.kind == "sim"))):
            return None
        placement = self.plan.placement
        groups = self._later_groups_of_router[name]
        if placement[name] is not Placement.RESIDENT or any(placement[g] is not Placement.RESIDENT
                                                             for g in groups):
            return None
        return groups

    def _moe_layer_on_cpu(self, name: str, w, x: torch.Tensor, fused: set[str]) -> torch.Tensor | None:
        """Router `name`'s whole layer for a step of up to `kernels.MOE_MAX_T` tokens in one native call
        (`moe.layer_cpu`) where the router and every expert group of the layer are on the CPU; adds the
        groups to `fused`. None: not such a step (the general path runs it)."""
        if (not self.cpu_moe_layer or self.moe_steps.get(name, 0) is not None or x.shape[0] > kernels.MOE_MAX_T
                or x.is_cuda):
            return None
        kept = self._cpu_tables.get(name)
        if kept is None or kept[0] is not self.plan:     # (worked out once per plan: a plan never changes)
            placement = self.plan.placement
            groups = self._later_groups_of_router[name]
            parts = table = None
            if placement[name] is Placement.CPU and all(placement[g] is Placement.CPU for g in groups):
                # (a CPU group's weights are its host views, which live as long as the executor)
                parts = [(self._weights(g), self.moe_steps[g][0]) for g in groups]
                table = moe.expert_table(self.cfg, parts)
            kept = (self.plan, groups, parts, table)
            self._cpu_tables[name] = kept
        _, groups, parts, table = kept
        if table is None:
            return None
        y = moe.layer_cpu(self.cfg, w, parts, x, table)
        if y is not None:
            fused.update(groups)
            if self._routed_now and self.slot_content:
                self._pump()       # (loads queued for a router: this layer streams nothing itself)
        return y

    def _moe_layer_on_gpu(self, name: str, w, groups: list[str], x: torch.Tensor, fused: set[str]):
        """A MoE layer whose router and groups are all in VRAM, for a step of a few tokens, with no host
        wait (a one-token step from a CUDA graph where they are on)."""
        parts = [(self.store.resident[g][1], self.moe_steps[g][0]) for g in groups]
        fused.update(groups)
        if self.graphs is None or not self.graphs.applies(x):
            return moe.layer_few_tokens(self.cfg, w, parts, x)
        flat = {f"r.{k}": v for k, v in w.items()}
        for i, (wg, _) in enumerate(parts):
            flat.update({f"{i}.{k}": v for k, v in wg.items()})
        ranges = [experts for _, experts in parts]

        def run(f, x_):
            return moe.layer_few_tokens(
                self.cfg, {k[2:]: v for k, v in f.items() if k.startswith("r.")},
                [({k.split(".", 1)[1]: v for k, v in f.items() if k.startswith(f"{i}.")}, r)
                 for i, r in enumerate(ranges)], x_)
        return self.graphs.run("moe", run, flat, x).clone()

    def _cpu_groups(self, name: str, w, s, fused: set[str]):
        """Expert group `name` on the CPU together with the groups of its layer that follow it there (one
        native pool job per projection for all their routed experts); adds those to `fused`."""
        experts, last = self.moe_steps[name]
        parts = [(w, experts)]
        placement = self.plan.placement
        for nxt in self._later_groups[name]:
            if placement[nxt] is not Placement.CPU:
                break
            experts, last = self.moe_steps[nxt]
            parts.append((self.store.sublayers[nxt].host_views, experts))
            fused.add(nxt)
        s = moe.experts_blocks(self.cfg, parts, s)
        if last:
            self._routing.pop(self._moe_layer[name], None)
            return moe.finish(s)
        return s

    def _wait_gpu(self) -> None:
        self.accel.wait_queued()

    def _head(self, w, x: torch.Tensor, at_once: int = HEAD_ROWS) -> torch.Tensor:
        """Logits in chunks of `at_once` rows (on the GPU `memory.head_rows_at_once`, what the scratch
        budget holds; HEAD_ROWS on the CPU), each moved to the CPU at once, so the float32 logits of a long
        input never pile up in VRAM."""
        if x.shape[0] <= at_once:
            return dense.output_head(self.cfg, w, x)
        return torch.cat([self._move(dense.output_head(self.cfg, w, x[i:i + at_once]), False)
                          for i in range(0, x.shape[0], at_once)])

    def _attention(self, layer, w, x, segs: list[_Segment], decode: _DecodeGroup | None, cos_sin, dev):
        self.kv.ready(layer)          # (a spill's copies of this layer's cache may still run on their thread)
        want_gpu = self.plan.kv_on_gpu(layer)
        if self.kv.pools[layer].on_gpu != want_gpu:
            self.kv.place_layer(layer, want_gpu)
        gqa = self.cfg.num_kv_heads != self.cfg.num_heads
        host_kv = self.plan.host_kv_attention(layer)

        def attend(q, k, v):
            if host_kv:
                return self._attend_over_host_kv(layer, q, k, v, segs, decode, gqa)
            self.kv.write_many(layer, [(s.seq, s.start, s.n) for s in segs], k, v)
            if len(segs) == 1:
                s = segs[0]
                out = self._decode_natively(layer, s, q)
                if out is not None:
                    return out
                keys, values = self.kv.read(layer, s.seq, s.start + s.n)
                return self._attend_one(layer, q, keys, values, s, gqa)
            out = torch.empty_like(q)
            if decode is not None and self.kv.attend_decode(layer, [(s.seq, s.start + 1) for s in decode.segs], q,
                                                            [s.row for s in decode.segs], out) is None:
                # the decode tokens: one padded attention over their caches
                keys, values, valid = self.kv.read_padded(layer, [(s.seq, s.start + 1) for s in decode.segs])
                rows = decode.rows[dev]
                if self._one_token_kernel(layer, decode.segs, q):
                    od = dense.attend_one_token_batch(q.index_select(1, rows).transpose(0, 1), keys, values, valid)
                    out.index_copy_(1, rows, od.transpose(0, 1))
                else:
                    qd = q.index_select(1, rows).transpose(0, 1).unsqueeze(2)   # [B, heads, 1, head_dim]
                    od = _attend_padded(qd, keys, values, valid, gqa)
                    out.index_copy_(1, rows, od.squeeze(2).transpose(0, 1))
            for s in segs:
                if decode is None or s not in decode.segs:
                    if self._decode_natively(layer, s, q, out) is not None:
                        continue
                    keys, values = self.kv.read(layer, s.seq, s.start + s.n)
                    out[:, s.row:s.row + s.n] = dense._attend(q[:, s.row:s.row + s.n], keys, values,
                                                              s.masks[dev], gqa)
            return out

        cos, sin = cos_sin
        pool = self.kv.pools[layer]
        if (self.cpu_attention_call and not x.is_cuda and (len(segs) == 1 or self.cpu_attention_batch)
                and all(s.n == 1 and s.masks[dev] is None for s in segs)
                and not host_kv and not pool.on_gpu and not pool.fp8 and pool.parts is not None
                and self.plan.placement[f"layers.{layer}.attn"] is Placement.CPU):
            # one native call (`kernels.attention_decode`; a batch's decode tokens together,
            # `attention_decode_many`): norm, projections, q/k norms, RoPE, the cache writes, attention and the
            # output projection, with the tensor path's bits
            cfg = self.cfg
            if len(segs) == 1:
                s = segs[0]
                y = kernels.attention_decode(x, w, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cos[0], sin[0],
                                             pool.parts[0], pool.parts[1], self.kv.decode_table(s.seq, s.start + 1),
                                             s.start)
            else:
                y = kernels.attention_decode_many(x, w, cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cos, sin,
                                                  pool.parts[0], pool.parts[1],
                                                  [self.kv.decode_table(s.seq, s.start + 1) for s in segs],
                                                  [s.start for s in segs])
            if y is not None:
                return y
        if (self.graphs is not None and self.graphs.applies(x) and self.graph_attention and len(segs) == 1
                and segs[0].n == 1 and not host_kv and pool.on_gpu and not pool.fp8
                and graphs.fits_padded_context(segs[0].start + 1, self._kv_token_bytes(layer))):
            return self._attention_captured(w, x, segs[0], pool, cos, sin)
        if self.graphs is not None and self.graphs.applies(x):
            cs = self.graphs.rope(cos, sin)
            q, k, v = self.graphs.run("attn", lambda w_, x_: dense.attention_qkv(self.cfg, w_, x_, *cs), w, x)
        else:
            q, k, v = dense.attention_qkv(self.cfg, w, x, cos, sin)
        return dense.attention_out(self.cfg, w, x, q, k, v, None, None, None, attend)

    def _attention_from_host(self, name: str, x: torch.Tensor, segs: list[_Segment], cos_sin) -> torch.Tensor | None:
        """Attention sub-layer `name` on the GPU for a one-token `x` on the host whose next sub-layer runs on
        the host too (a MoE decode's attention between CPU expert layers), from its captured graph with the
        hidden state crossing straight into the graph's input and out of its output
        (`OneTokenGraphs.run_host`): a host tensor, or None where that does not apply (the sub-layer then
        takes the usual way, which captures the graph)."""
        nxt = self._next.get(name)
        if (self.plan.placement[name] is not Placement.RESIDENT or nxt is None
                or self.plan.placement[nxt] is not Placement.CPU):
            return None
        layer = int(name.split(".")[1])
        self.kv.ready(layer)
        pool = self.kv.pools[layer]
        if (len(segs) != 1 or segs[0].n != 1 or not self.graph_attention or self.plan.host_kv_attention(layer)
                or not pool.on_gpu or pool.fp8 or not self.plan.kv_on_gpu(layer)
                or not graphs.fits_padded_context(segs[0].start + 1, self._kv_token_bytes(layer))):
            return None
        wk = self._captured_inputs(self._weights(name), segs[0], pool, x.device if x.is_cuda else pool.parts[0].device)
        g = self.graphs
        g.rope(*cos_sin)
        return g.run_host("attnkv", wk, x, self.accel.wait_queued)

    def _captured_inputs(self, w, s: _Segment, pool, device) -> dict[str, torch.Tensor]:
        """A captured decode attention's inputs beside its weights: the cache pools and the step's index
        buffers (`OneTokenGraphs.decode_index`)."""
        rows, table, valid = self.graphs.decode_index(s.seq.block_table, s.start, self.cfg.sliding_window, device)
        return {**w, "kv.k": pool.parts[0], "kv.v": pool.parts[1], "kv.rows": rows, "kv.table": table,
                "kv.valid": valid}

    def _attention_captured(self, w, x: torch.Tensor, s: _Segment, pool, cos, sin) -> torch.Tensor:
        """A one-token attention on the GPU whole, its cache write and its attention over a padded
        context included (`OneTokenGraphs.decode_index`, `dense.attend_one_token`), from one graph."""
        cfg, g = self.cfg, self.graphs
        cs = g.rope(cos, sin)
        wk = self._captured_inputs(w, s, pool, x.device)

        def run(w_, x_):
            kp, vp = w_["kv.k"], w_["kv.v"]

            def attend(q, k, v):
                for part, new in ((kp, k), (vp, v)):
                    part.view(-1, *part.shape[2:]).index_copy_(0, w_["kv.rows"], new.transpose(0, 1).to(part.dtype))
                keys, values = (p.index_select(0, w_["kv.table"]).view(-1, *p.shape[2:]).transpose(0, 1)
                                for p in (kp, vp))
                return dense.attend_one_token(q, keys, values, w_["kv.valid"])
            return dense.attention_out(cfg, w_, x_, *dense.attention_qkv(cfg, w_, x_, *cs), None, None, None, attend)
        return g.run("attnkv", run, wk, x).clone()

    def _decode_natively(self, layer: int, s: _Segment, q: torch.Tensor, out: torch.Tensor | None = None):
        """Segment `s`'s attention through the native kernel over a CPU pool where it is one decode token
        (into `out`'s rows of it where given, else a new tensor); None where that does not apply."""
        if s.n != 1 or s.masks[q.device] is not None:
            return None
        return self.kv.attend_decode(layer, [(s.seq, s.start + 1)], q, None if out is None else [s.row], out)

    def _attend_over_host_kv(self, layer: int, q, k, v, segs: list[_Segment], decode: _DecodeGroup | None,
                             gqa: bool) -> torch.Tensor:
        """Attention on the GPU over a KV cache kept in host memory (the plan books one layer's KV in
        scratch): the new keys and values are copied out to the (pinned) host pool and the cached ones in,
        both queued on the stream, so the host never waits for the GPU. The new ones take part as a read
        after the write would return them (an FP8 pool rounds them). A batch's decode tokens go over
        together (their contexts gathered on the host into one padded copy, one kernel call); the other
        sequences one at a time."""
        self.kv.write_from_device(layer, [(s.seq, s.start, s.n) for s in segs], k, v)
        k, v = self.kv.as_stored(layer, k, v)
        out = torch.empty_like(q)
        together = decode is not None and self._one_token_kernel(layer, decode.segs, q)
        if together:
            keys, values, valid = self.kv.read_padded_to(layer, [(s.seq, s.start + 1) for s in decode.segs],
                                                         q.device)
            rows = decode.rows[q.device]
            # each token's own key and value, at its position (the host pool's copy of them is still queued)
            at = self.kv.positions_index([s.start for s in decode.segs], q.device)
            for cache, new in ((keys, k), (values, v)):
                cache.transpose(1, 2).index_put_(at, new.index_select(1, rows).transpose(0, 1))
            od = dense.attend_one_token_batch(q.index_select(1, rows).transpose(0, 1), keys, values, valid)
            out.index_copy_(1, rows, od.transpose(0, 1))
        for s in segs:
            if together and s in decode.segs:
                continue
            # (a simulated accelerator's q is on the CPU: its decode tokens take the native kernel, as under
            # any other plan)
            if self._decode_natively(layer, s, q, out) is not None:
                continue
            keys, values = k[:, s.row:s.row + s.n], v[:, s.row:s.row + s.n]
            if s.start:
                past_k, past_v = self.kv.read_to(layer, s.seq, s.start, q.device)
                keys, values = torch.cat([past_k, keys], 1), torch.cat([past_v, values], 1)
            out[:, s.row:s.row + s.n] = self._attend_one(layer, q[:, s.row:s.row + s.n], keys, values, s, gqa)
        return out

    def _attend_one(self, layer: int, q, keys, values, s: _Segment, gqa: bool) -> torch.Tensor:
        """Segment `s`'s attention over its whole context in `keys`/`values`. A one-token step on the GPU
        whose context a captured attention would cover takes that graph's kernel (`dense.attend_one_token`
        under a mask, which gives the same bits over the exact context as over the padded one): the
        token comes out the same whether this plan captures its attention or not, keeps its KV in VRAM or
        in host memory."""
        if s.n == 1 and q.is_cuda and graphs.fits_padded_context(s.start + 1, self._kv_token_bytes(layer)):
            return dense.attend_one_token(q, keys, values,
                                          graphs.visible(s.start + 1, s.start, self.cfg.sliding_window, q.device))
        return dense._attend(q, keys, values, s.masks[q.device], gqa)

    def _one_token_kernel(self, layer: int, segs: list[_Segment], q: torch.Tensor) -> bool:
        """Whether these one-token segments attend through `dense.attend_one_token(_batch)`: on the GPU,
        every context within the captured range (as `_attend_one` decides for one)."""
        if not q.is_cuda:
            return False
        tb = self._kv_token_bytes(layer)
        return all(s.n == 1 and graphs.fits_padded_context(s.start + 1, tb) for s in segs)

    def _kv_token_bytes(self, layer: int) -> int:
        return self.kv.pools[layer].block_bytes() // BLOCK_SIZE

    def _move(self, x: torch.Tensor, to_gpu: bool) -> torch.Tensor:
        if self.accel is None or self.accel.kind == "sim":
            return x
        if to_gpu and x.device.type == "cpu":
            return self.accel.to_device(x)
        if not to_gpu and x.device.type != "cpu":
            return self.accel.to_host(x)
        return x

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.clear()
        if self.accel is not None:
            self._drain_slots()
            self.store.close()
            self.kv.close()
            self.accel.unbook(self.scratch_booked, "scratch")
            self.scratch_booked = 0
        self.plan = None


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _tally(times: dict, last: str | None, t_last: float, key: str | None) -> tuple[float, str | None]:
    """Close the sub-layer `last` (started at `t_last`) into `times`; start `key` now."""
    now = time.perf_counter()
    if last is not None:
        entry = times.setdefault(last, [0, 0.0])
        entry[0] += 1
        entry[1] += now - t_last
    return now, key
