"""The vision pass as the engine runs it (VLMOpt), and what it costs in VRAM and time.

Weights: the tower's weights are packed once into one host buffer per group (`vision_groups`: the
patch embedding, each block, the merger; pinned on CUDA) and never stay in VRAM. A pass on the GPU
streams them through two slots on the copy engine (double-buffered: the next group copies while one
computes), books the slots (tag "slots") and its activations ("scratch") against the engine's VRAM
budget through the `Accelerator`, and releases both before the language model runs again: the peak is
the larger of the two passes, not their sum. Where the language model's plan leaves less free than
the pass needs, the engine first activates its plan for the budget less the pass (its weights and KV
make room) and its full plan returns at the next language-model step.

Memory: a work cap bounds the temporaries. Attention tiles its queries (`segmented_attention`) and each
block runs its row-wise parts in chunks (`vision_block(rows=)`), so only x, q, k, v and the attention
output are whole-image tensors. `activation_bytes` prices the peak of every phase from the shapes, with
a margin for allocator rounding.

Time (`pass_costs`): per group, the GEMM FLOPs at the profile's rates for the patch count, attention from
its FLOPs and the key/value bytes its query tiles read, elementwise traffic at memory bandwidth, and
per-kernel overhead (added on the CPU; on the GPU the larger of kernel time and issue time). On the GPU
the groups' copies over PCIe overlap compute two slots deep, plus the pixels in and the embeddings out.
`plan_vision_pass` prices every work cap that fits the budget, the GPU side also paying to copy back
what the language model released, and picks the fastest of those and the CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from engine.errors import OutOfBudgetError
from engine.models.vision.qwen2_5_vl_tower import (
    VisionConfig,
    attention_calls,
    attention_work_bytes,
    image_lengths,
    run_tower,
    vision_groups,
    vision_weight_names,
    vision_weight_shapes,
    window_order,
)

MIB = 1 << 20
WORK_CAPS = tuple(c * MIB for c in (256, 128, 64, 32, 16, 8, 4, 2, 1)) + (256 << 10, 64 << 10, 16 << 10)
N_SLOTS = 2
ACT_MARGIN = 1.25           # activations x margin (allocator rounding, fragmentation, small temporaries)
SLACK_MAX = 16 * MIB        # fixed extra (index tensors, kernel workspace), scaled down for tiny towers
ALIGN = 256                 # as engine.sharding.weights packs tensors
OPS_PER_CHUNK = 28          # kernels per row chunk of a block (norms, projections, rotary, MLP)
WHERE = ("auto", "gpu", "cpu")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- shapes and bytes ----------------------------------------------------------------------------

def group_locals(vcfg: VisionConfig) -> dict[str, dict[str, str]]:
    """group -> {name inside the group: canonical weight name}, groups in running order."""
    names = vision_weight_names(vcfg)
    out = {}
    for group in vision_groups(vcfg):
        prefix = "vision." if group == "vision.embed" else group + "."
        out[group] = {n[len(prefix):]: n for n in names[group]}
    return out


def group_bytes(vcfg: VisionConfig, dtype_bytes: int) -> dict[str, int]:
    """Bytes of each group's packed buffer (each tensor rounded up to ALIGN)."""
    shapes = vision_weight_shapes(vcfg)
    return {g: sum(-(-math.prod(shapes[n]) * dtype_bytes // ALIGN) * ALIGN for n in names.values())
            for g, names in group_locals(vcfg).items()}


@dataclass(frozen=True)
class PassShape:
    """What a pass's cost depends on: patches, image tokens, and the attention segments."""
    patches: int
    tokens: int
    window_lengths: tuple[int, ...]
    full_lengths: tuple[int, ...]

    @classmethod
    def from_grids(cls, vcfg: VisionConfig, grids) -> PassShape:
        grids = [tuple(int(v) for v in g) for g in (grids.tolist() if torch.is_tensor(grids) else grids)]
        n = sum(t * h * w for t, h, w in grids)
        return cls(n, n // vcfg.merge_unit, tuple(window_order(grids, vcfg)[1]), tuple(image_lengths(grids)))


def _row_bytes(vcfg: VisionConfig, db: int) -> int:
    """Temporaries per row of a block's row-wise phases (the largest of them)."""
    h, f = vcfg.hidden_size, vcfg.intermediate_size
    norm = h * (12 + 2 * db)                      # float32 copy, its square, the product, casts
    qkv = 3 * h * db + h * (22 + db)              # the projection and the float32 rotary of q or k
    out = 3 * h * db                              # reshaped output, projection, sum
    mlp = 3 * f * db + 2 * h * db + norm          # gate/act, up, product; down, sum
    pixels = vcfg.patch_dim * (4 + db) + h * db   # the patch embedding: float32 pixels, cast, projected
    merger = h * (12 + 5 * db)                    # norm, fc1, GELU (fc2's output is a quarter row)
    return max(norm, qkv, out, mlp, pixels, merger)


def rows_for(vcfg: VisionConfig, patches: int, dtype_bytes: int, work_cap: int) -> int:
    """Rows per chunk so that one chunk's temporaries stay within `work_cap` (all rows if they do)."""
    return max(1, min(patches, work_cap // _row_bytes(vcfg, dtype_bytes)))


def activation_bytes(vcfg: VisionConfig, shape: PassShape, dtype_bytes: int, work_cap: int,
                     rows: int | None = None) -> int:
    """Peak VRAM of the pass's activations (weights excluded), margin included."""
    n, h, db = shape.patches, vcfg.hidden_size, dtype_bytes
    if n == 0:
        return 0
    rows = rows_for(vcfg, n, db, work_cap) if rows is None else rows
    nh = n * h * db
    r = _row_bytes(vcfg, db) * min(rows, n)
    heads, d = vcfg.num_heads, vcfg.head_dim
    attn_work = max(attention_work_bytes(shape.window_lengths, heads, d, db, work_cap),
                    attention_work_bytes(shape.full_lengths, heads, d, db, work_cap))
    rope = 2 * n * d * 4 + 3 * n * 8                        # cos, sin (float32), index tensors
    pixels = min(rows, n) * (vcfg.patch_dim * (4 + db) + h * db)   # a chunk of float32 pixels, cast, projected
    embed = pixels + 2 * nh                                  # + the projection and its window order
    if rows >= n:                                            # the whole block at once
        block = max(4 * nh + r, 5 * nh + attn_work, 5 * nh, 2 * nh + r)
    else:
        block = max(4 * nh + r, 5 * nh + attn_work, 2 * nh + r, nh + r)
    tok_out = shape.tokens * vcfg.out_hidden_size * db
    merge_rows = min(n, -(-min(rows, n) // vcfg.merge_unit) * vcfg.merge_unit)
    merger = nh + 2 * tok_out + merge_rows * h * (12 + 5 * db)
    return math.ceil((rope + max(embed, block, merger)) * ACT_MARGIN)


# ---- time ----------------------------------------------------------------------------------------

def pass_costs(vcfg: VisionConfig, shape: PassShape, prof, side: str, dtype: str, dtype_bytes: int,
               work_cap: int) -> list[float]:
    """Milliseconds of each group's compute (running order) on `side` ("cpu" | "gpu")."""
    n, h, f, db = shape.patches, vcfg.hidden_size, vcfg.intermediate_size, dtype_bytes
    heads, d = vcfg.num_heads, vcfg.head_dim
    rows = rows_for(vcfg, n, db, work_cap)
    chunks = -(-n // rows)

    def total(t: float, n_ops: int) -> float:
        issue = prof.op_ms(side, n_ops)
        return t + issue if side == "cpu" else max(t, issue)

    out = [total(prof.gemm_ms(side, dtype, "ffn", 2 * h * vcfg.patch_dim, n)
                 + prof.mem_ms(side, n * (vcfg.patch_dim * 4 + 2 * h * db)), 4)]
    gemm = prof.gemm_ms(side, dtype, "ffn", 2 * (4 * h * h + 3 * h * f), n)
    elementwise = prof.mem_ms(side, n * h * 80 + 4 * n * f * db)

    def block(lengths) -> float:
        calls, kv_bytes = attention_calls(lengths, heads, d, db, work_cap)
        attn = prof.attention_ms(side, dtype, kv_bytes + 2 * n * h * db, 4.0 * h * sum(x * x for x in lengths))
        return total(gemm + attn + elementwise, chunks * OPS_PER_CHUNK + calls)

    per_kind = {False: block(shape.window_lengths), True: block(shape.full_lengths)}
    full = set(vcfg.fullatt_block_indexes)
    out += [per_kind[i in full] for i in range(vcfg.depth)]
    mh = h * vcfg.merge_unit
    out.append(total(prof.gemm_ms(side, dtype, "ffn", 2 * (mh * mh + vcfg.out_hidden_size * mh), shape.tokens)
                     + prof.mem_ms(side, n * h * 20), 8))
    return out


def streamed_ms(compute: list[float], copies: list[float], n_slots: int, start: float = 0.0) -> float:
    """Finish time of groups computed in order from `n_slots` slots the copy engine fills in order: a
    group's copy waits for the previous copy and for its slot's previous group to finish computing."""
    copy_end, comp_end = [], []
    for i, (k, c) in enumerate(zip(compute, copies)):
        c0 = max(copy_end[-1] if copy_end else 0.0, comp_end[i - n_slots] if i >= n_slots else 0.0)
        copy_end.append(c0 + c)
        comp_end.append(max(comp_end[-1] if comp_end else start, copy_end[-1]) + k)
    return comp_end[-1] if comp_end else start


# ---- the plan ------------------------------------------------------------------------------------

@dataclass
class VisionPassPlan:
    where: str                       # "gpu" (weights streamed) | "cpu"
    patches: int
    tokens: int                      # image tokens handed to the language model
    n_slots: int = 0
    slot_bytes: int = 0              # per slot
    activation_bytes: int = 0
    work_cap: int = WORK_CAPS[0]     # attention tiles and row chunks stay under this
    rows: int = 0                    # rows per chunk of a block's row-wise work
    room_bytes: int = 0              # VRAM the language model releases for the pass
    gpu_ms: float = math.nan         # predicted, weights streamed (incl. bringing back the released bytes)
    cpu_ms: float = math.nan         # predicted, on the CPU
    reason: str = ""

    @property
    def vram_bytes(self) -> int:
        return self.n_slots * self.slot_bytes + self.activation_bytes if self.where == "gpu" else 0

    @property
    def predicted_ms(self) -> float:
        return self.gpu_ms if self.where == "gpu" else self.cpu_ms

    def report(self) -> dict:
        out = asdict(self)
        out.update(vram_bytes=self.vram_bytes, predicted_ms=self.predicted_ms)
        return out


def plan_vision_pass(vcfg: VisionConfig, grids, dtype: torch.dtype, *, prof=None, budget: int = 0,
                     lm_used: int = 0, where: str = "auto", work_cap: int | None = None,
                     sizes: dict[str, int] | None = None) -> VisionPassPlan:
    """Where and how to run the vision pass for these image grids. `budget`: the engine's VRAM budget;
    `lm_used`: what the language model holds now (it can release all of it); `prof`: the profile
    (None: no accelerator, the CPU). `where` forces a side ("gpu" still falls back to the CPU when
    nothing fits the budget); `work_cap` forces the cap."""
    if where not in WHERE:
        raise ValueError(f"where={where!r}: expected one of {WHERE}")
    shape = PassShape.from_grids(vcfg, grids)
    db = torch.tensor([], dtype=dtype).element_size()
    dt = _DTYPE_NAMES.get(dtype, "float32")
    plan = VisionPassPlan("cpu", shape.patches, shape.tokens)
    caps = (work_cap,) if work_cap else WORK_CAPS
    if prof is not None:
        plan.cpu_ms = sum(pass_costs(vcfg, shape, prof, "cpu", dt, db, caps[0]))
    if prof is None or not prof.has_gpu or budget <= 0 or where == "cpu":
        plan.reason = "forced to the CPU" if where == "cpu" else "no accelerator budget"
        plan.rows = rows_for(vcfg, shape.patches, db, caps[0])
        plan.work_cap = caps[0]
        return plan
    sizes = sizes or group_bytes(vcfg, db)
    slot = max(sizes.values())
    order = list(group_locals(vcfg))
    copies = [prof.copy_ms(sizes[g]) for g in order]
    start = prof.move_ms(shape.patches * vcfg.patch_dim * 4, True)
    back = prof.move_ms(shape.tokens * vcfg.out_hidden_size * db, False)
    free = max(budget - lm_used, 0)
    best = None
    for cap in caps:
        rows = rows_for(vcfg, shape.patches, db, cap)
        act = activation_bytes(vcfg, shape, db, cap, rows) + min(SLACK_MAX, sum(sizes.values()) // 16)
        vram = N_SLOTS * slot + act
        if vram > budget:
            continue
        room = max(vram - free, 0)
        ms = streamed_ms(pass_costs(vcfg, shape, prof, "gpu", dt, db, cap), copies, N_SLOTS, start) + back
        ms += prof.copy_ms(room) if room else 0.0
        if best is None or ms < best[0]:
            best = (ms, cap, rows, act, room)
    if best is None:
        plan.reason = "no work cap fits the VRAM budget"
        plan.rows = rows_for(vcfg, shape.patches, db, caps[-1])
        plan.work_cap = caps[-1]
        return plan
    ms, cap, rows, act, room = best
    plan.gpu_ms = ms
    if where == "auto" and not ms < plan.cpu_ms:
        plan.reason = "the CPU is predicted faster"
        plan.rows, plan.work_cap = rows_for(vcfg, shape.patches, db, WORK_CAPS[0]), WORK_CAPS[0]
        return plan
    plan.where, plan.n_slots, plan.slot_bytes = "gpu", N_SLOTS, slot
    plan.activation_bytes, plan.work_cap, plan.rows, plan.room_bytes = act, cap, rows, room
    plan.reason = "forced to the GPU" if where == "gpu" else "the GPU is predicted faster"
    return plan


# ---- running it ----------------------------------------------------------------------------------

class VisionPass:
    """The tower's packed host weights, and passes over them on the GPU (streamed) or the CPU."""

    def __init__(self, vcfg: VisionConfig, weights: dict[str, torch.Tensor], accel, dtype: torch.dtype):
        from engine.sharding.weights import SubLayerWeights

        self.vcfg, self.accel, self.dtype = vcfg, accel, dtype
        pin = accel is not None and accel.kind == "cuda"
        self.groups = {g: SubLayerWeights(g, {local: weights[name].to(dtype) for local, name in names.items()}, pin)
                       for g, names in group_locals(vcfg).items()}
        self.order = list(self.groups)
        self.sizes = {g: sw.nbytes for g, sw in self.groups.items()}
        # canonical name -> host view (the packed buffers are the only copy kept)
        self.host_weights = {name: self.groups[g].host_views[local]
                             for g, names in group_locals(vcfg).items() for local, name in names.items()}
        self.where = "auto"           # "gpu" / "cpu" force the side
        self.work_cap: int | None = None
        self.last: dict | None = None
        self.passes = 0

    @property
    def weight_bytes(self) -> int:
        return sum(self.sizes.values())

    def plan(self, grids, prof=None, budget: int = 0, lm_used: int = 0) -> VisionPassPlan:
        if self.accel is None:
            prof, budget = None, 0
        return plan_vision_pass(self.vcfg, grids, self.dtype, prof=prof, budget=budget, lm_used=lm_used,
                                where=self.where, work_cap=self.work_cap, sizes=self.sizes)

    def run(self, pixel_values: torch.Tensor, grids, plan: VisionPassPlan, interrupt=None) -> torch.Tensor:
        """Embeddings [image tokens, out_hidden] on the CPU. `interrupt()`, asked before each group on
        the GPU, moves the rest of the pass to the CPU when it says so (a budget drop)."""
        t0 = time.perf_counter()
        before = self.accel.total_used if self.accel is not None else 0
        info = {"where": plan.where, "fell_back": None, "booked_bytes": 0, "in_use_during_pass": before}
        out = None
        if plan.where == "gpu":
            try:
                out = self._run_gpu(pixel_values, grids, plan, interrupt, info)
            except (OutOfBudgetError, torch.OutOfMemoryError) as exc:
                info["fell_back"] = f"{type(exc).__name__}: {exc}"
                info["where"] = "cpu"
        if out is None:
            out = self._run_cpu(pixel_values, grids, plan)
        self.passes += 1
        self.last = {"plan": plan.report(), **info, "measured_ms": (time.perf_counter() - t0) * 1e3}
        return out

    def _run_cpu(self, pixel_values, grids, plan: VisionPassPlan) -> torch.Tensor:
        def fetch(group, x):
            return self.groups[group].host_views, (x.cpu() if x is not None else None)

        return run_tower(self.vcfg, pixel_values, grids, fetch, dtype=self.dtype, attn_mem_cap=plan.work_cap,
                         rows=plan.rows)

    def _run_gpu(self, pixel_values, grids, plan: VisionPassPlan, interrupt, info: dict) -> torch.Tensor:
        accel = self.accel
        n = plan.n_slots
        slots: list[torch.Tensor] = []
        ready: list = [None] * n
        free_after: list = [None] * n
        index = {g: i for i, g in enumerate(self.order)}
        state = {"cpu": False, "booked": 0}

        def load(i: int) -> None:
            sw = self.groups[self.order[i]]
            ready[i % n] = accel.copy_async(slots[i % n][:sw.nbytes], sw.host, after=free_after[i % n])

        def release() -> None:
            for h in ready:
                if h is not None:
                    h.wait_host()
            for buf in slots:
                accel.free(buf, "slots")
            slots.clear()
            accel.unbook(state["booked"], "scratch")
            state["booked"] = 0

        def fetch(group, x):
            if not state["cpu"] and interrupt is not None and interrupt():
                x = accel.to_host(x) if x is not None else None
                release()
                state["cpu"] = True
                info["fell_back"] = f"the VRAM budget dropped before {group}: the rest ran on the CPU"
                info["where"] = "gpu+cpu"
            if state["cpu"]:
                return self.groups[group].host_views, (x.cpu() if x is not None else None)
            slot = index[group] % n
            ready[slot].wait_compute()
            return self.groups[group].views(slots[slot]), (accel.to_device(x) if x is not None else None)

        def done(group):
            if state["cpu"]:
                return
            i = index[group]
            free_after[i % n] = accel.compute_event()
            if i + n < len(self.order):
                load(i + n)

        try:
            for _ in range(n):
                slots.append(accel.alloc(plan.slot_bytes, "slots", "vision streaming slot"))
            accel.book(plan.activation_bytes, "scratch", "vision pass activations")
            state["booked"] = plan.activation_bytes
            info["booked_bytes"] = plan.vram_bytes
            info["in_use_during_pass"] = accel.total_used
            for i in range(min(n, len(self.order))):
                load(i)
            out = run_tower(self.vcfg, pixel_values, grids, fetch, dtype=self.dtype, attn_mem_cap=plan.work_cap,
                            rows=plan.rows, done=done)
            return accel.to_host(out) if out.device.type != "cpu" else out
        finally:
            release()


__all__ = ["N_SLOTS", "WORK_CAPS", "PassShape", "VisionPass", "VisionPassPlan", "activation_bytes", "group_bytes",
           "group_locals", "pass_costs", "plan_vision_pass", "rows_for", "streamed_ms"]
