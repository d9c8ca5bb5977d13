"""The roofline estimator: predicted milliseconds per step of a placement, modelling the executor's pipeline.

Per sub-layer costs come from the profile (`StepCosts`): matmuls from the measured GFLOP/s tables,
attention over the context from KV bytes read and FLOPs, a per-op overhead (added on the CPU; on the
GPU the kernels run while the host issues the next, so the larger of the two counts), activation moves
between CPU and GPU (bytes over PCIe plus a fixed latency) wherever consecutive sub-layers change sides.

`engine.sharding.pipeline` then replays the executor's schedule of a step over those costs, for many
placements at once, and reports the steady-state step time.

Mixture-of-experts layers: a step of t tokens reads only the experts its tokens are routed to. Assuming
uniform routing (each token picks k of the E experts independently of the others; real routers are
skewed, which touches fewer), an expert group of G experts has ~G(1 - (1 - k/E)^t) touched experts, each
a matmul over t*k*G/E / touched rows on average, and per-op overhead per touched expert. So a decode
step on the CPU reads about k/E of the expert bytes while a long prefill reads them all. Streaming a
group copies the whole group ahead of time, except in tiers where `spec.routed_streaming` holds (few
experts touched: decode, short steps): there it copies the touched experts' bytes only, and not before
its layer's router has run (`StepCosts.copy_gate`; the pipeline replay holds the copy back till then).
Crossing sides inside a MoE layer moves the MoE state (hidden state, normed input, partial sum and the
routing), not just the hidden state.

An attention streamed to the GPU while its layer's KV cache stays in host memory (code HKV: small budgets,
where the KV of every layer does not fit beside the slots) also copies that layer's keys and values for
the step's context in, and the step's new ones out, on the copy engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.config import MOE_FEW_TOKENS as FEW_TOKENS
from engine.sharding.memory import sublayer_bytes, transfer_bytes
from engine.sharding.pipeline import CPU, HKV, RES, STR, Pipeline
from engine.sharding.plan import Placement
from engine.sharding.profile import ProfileDatabase
from engine.sharding.spec import DTYPE_BYTES, ModelSpec, SubLayerSpec, routed_streaming

__all__ = ["CPU", "HKV", "RES", "STR", "Estimator", "StepCosts", "step_costs"]
CODE = {Placement.CPU: CPU, Placement.RESIDENT: RES, Placement.STREAMED: STR}
# Host work of one sub-layer in a one-token step, by side: PyTorch ops (each costs the profile's op overhead
# on that side: on the CPU its dispatch, on the GPU its launch, which the host pays while earlier kernels
# run) and, on the CPU, native kernel calls (each wakes the matmul pool: the profile's `native_call_us`).
# Session 8 measured each kind's host time in decode on the H200 (`engine.bench.host_costs`) and these
# counts price it: a CPU attention of SmolLM2-135M 0.307 ms (36 ops, counted by the profiler over the sim
# device's decode, and 4 native calls at 4.2 and 33 us: 0.29, arithmetic 0.02), a CPU FFN 0.190 (11 and 3:
# 0.14, arithmetic 0.06), a GPU attention 0.386 (30 op-equivalents at 12.8 us: its 49 PyTorch ops include
# a dozen views that cost a few us each), a GPU FFN 0.194 (14: 0.18); the MoE router (26 ops on the GPU
# and 21 on the CPU, H200 trace) and the q/k norms (12 more GPU ops; one native call on the CPU) as
# traced. A MoE attention after CPU experts took 0.63-0.98 ms (42 here: 0.54; the crossing's copy and
# the cold caches count apart).
OPS = {"cpu": {"embed": 2, "attn": 36, "ffn": 11, "head": 7, "router": 21, "experts": 1},
       "gpu": {"embed": 2, "attn": 30, "ffn": 14, "head": 13, "router": 26, "experts": 1}}
QK_NORM_OPS = {"cpu": 0, "gpu": 12}      # q/k norms: one native call on the CPU, a dozen ops on the GPU
NATIVE_CALLS = {"embed": 0, "attn": 4, "ffn": 3, "head": 2, "router": 2, "experts": 0}
NATIVE_CALLS_EXPERTS_PER_LAYER = 3      # a layer's CPU expert groups run together: gate/up, down, sum
OPS_PER_EXPERT = 7     # kernels per touched expert (gather, gate/up, silu, mul, down, scale, index_add)
# A step's consecutive CPU expert groups of several tokens in one native job per projection
# (`moe._experts_batch`): the PyTorch ops around the jobs (the gather, the chunk, silu, mul, the weights'
# scale and cast) per run of groups, whatever the number of routed experts; priced per group, at most.
OPS_BULK_GROUP = 8
# ... and the bytes those ops move per routed pair, in units of the pair's hidden-size and intermediate-size
# rows: the gather (read, write), the weighted outputs (read, scale, cast) and the ordered add (read the
# output row, read and write the sum); silu and mul over gate and up (read two, write one, a temporary).
# On the H200 host the ops around a 512-token layer's jobs took 6.2 ms beside 22 ms in the jobs with the
# add on one thread (moe_cpu_experts, session 12); the add now runs on the pool.
BULK_HIDDEN_PASSES = 7
BULK_INTER_PASSES = 5
OPS_PER_EXPERT_SINGLE = 5   # in a one-token step (gate/up, silu, mul, down, multiply-add)
# A resident expert group in a step of 2 to moe.FEW_TOKENS tokens runs inside its layer's one call
# (`moe.layer_few_tokens`): all of its experts over the tokens, in this many kernels (the routing masks,
# two batched matmuls, silu and mul, the pick of each token's rows), with no per-expert launches. (A
# one-token step does too, from a graph where graphs are on; the per-expert price stays there, between
# the graph's and the eager call's.) Only a layer whose router and groups are all resident takes that
# call; the family's resident prefix leaves at most one layer partly resident, priced as if whole.
OPS_ONE_CALL_GROUP = 12
# A GPU expert group in a step of more than moe.FEW_TOKENS tokens that copies whole groups runs in padded
# runs of consecutive experts (`moe.experts_padded`): this many kernels per run (the index copy, the gathers,
# two batched matmuls, silu, mul, the weights) and OPS_PADDED_EXPERT per routed expert (its index_add and
# views); a run holds at most the step's token count of padded rows
OPS_PADDED_RUN = 10
OPS_PADDED_EXPERT = 2
# A MoE layer partly in VRAM (some expert groups resident, the rest or the router elsewhere) in a step of up to
# moe.FEW_TOKENS tokens: neither one-call path takes it (the GPU's `moe.layer_few_tokens`, the CPU's
# `moe.layer_cpu`), so the general path runs it, whose router reads the per-expert counts back to the host
# (the GPU's queue drains first) and whose groups launch per routed expert. Session 15, call PP (H200, the
# Qwen3-30B-A3B shape, 24 layers): at 8 GiB the decode plan kept four layers whole in VRAM and one with 5 of
# its 8 groups; its step took 36.3 ms against 32.5 at 4 GiB (one whole layer), where the per-sub-layer prices
# had it 0.8 ms faster. That layer's router took about 3.6 ms of host time, its resident groups 2.2 and its
# CPU groups 1.5, against about 0.4 for a whole layer in VRAM and 1.05 for one layer call on the CPU.
PARTIAL_MOE_LAYER_MS = 5.0


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of each sub-layer for one (n_tokens, ctx_len), on each side, and of the crossings."""
    gpu_ms: np.ndarray        # [S]
    cpu_ms: np.ndarray        # [S]
    to_gpu_ms: np.ndarray     # [S] moving sub-layer i's input to the GPU (token ids for i = 0)
    to_cpu_ms: float          # moving the hidden state to the host
    out_ms: float             # logits back to the host when the last sub-layer ran on the GPU
    stream_ms: float = 0.0    # host work per streamed sub-layer (issue its copy, order compute after it)
    # extra milliseconds of moving sub-layer i's input to the host beyond `to_cpu_ms` (a MoE state is
    # larger than the hidden state); None = none
    to_cpu_extra_ms: np.ndarray | None = None
    # Routed expert streaming in this tier: each sub-layer's copy time (alone, beside CPU work) replacing
    # the whole-buffer ones, and the index of the sub-layer whose end its copy waits for (-1: none)
    copy_alone_ms: np.ndarray | None = None
    copy_busy_ms: np.ndarray | None = None
    copy_gate: np.ndarray | None = None
    # A streamed attention over a host-resident KV cache (code HKV): copying the layer's keys and values
    # for the step's context in and the new ones out, alone and beside CPU work, per sub-layer [S]
    kv_copy_alone_ms: np.ndarray | None = None
    kv_copy_busy_ms: np.ndarray | None = None
    # GPU milliseconds of each sub-layer where it is resident, if that differs from `gpu_ms` for any
    # (resident expert groups in steps of a few tokens: `OPS_ONE_CALL_GROUP`); None = as `gpu_ms`
    gpu_res_ms: np.ndarray | None = None
    # A streamed dense FFN can leave the tail of its gate/up rows to the CPU (`Plan.ffn_cpu_rows`, a share
    # of them): per sub-layer, the host milliseconds of all its gate/up rows on the CPU with the move of
    # their output to the GPU (0 where no share applies), and the fraction of its copy those rows are
    share_cpu_ms: np.ndarray | None = None
    share_copy_frac: np.ndarray | None = None


def dtype_name(spec: ModelSpec) -> str:
    if DTYPE_BYTES.get(spec.config.dtype) == spec.dtype_bytes:
        return spec.config.dtype
    return "float32" if spec.dtype_bytes == 4 else "bfloat16"


def attention_parts_ms(prof: ProfileDatabase, side: str, dt: str, sub: SubLayerSpec, n: int,
                       ctx: int) -> tuple[float, float]:
    """(projections, attention over `ctx` context tokens) milliseconds of attention sub-layer `sub` in a
    step of `n` tokens on `side`, before op overhead (`OPS[side]["attn"]` ops). The profile's CPU attention
    block factor (`measure.attn_block_factors`) is calibrated against this."""
    return (prof.gemm_ms(side, dt, "attn", sub.flops_per_token, n),
            prof.attention_ms(side, dt, ctx * sub.kv_bytes_per_token, n * ctx * sub.attn_flops_per_token_ctx))


def cpu_bulk_gflops(prof: ProfileDatabase, dt: str, cfg, n: int) -> float | None:
    """The GFLOP/s of a step's CPU expert groups in one native job per projection (`moe._experts_batch`)
    at `n` tokens, from the profile's expert-job table; None where the engine takes them expert by expert
    instead: no table (older profiles), or the busiest expert's rows (about the mean + 3 sigma) past the
    rows the table measured (what the kernel takes: 16 without AMX tiles)."""
    mean = n * cfg.num_experts_per_tok / cfg.num_experts
    if prof.experts_gflops(dt, min(n, mean + 3 * math.sqrt(mean) + 1)) is None:
        return None
    touched = cfg.num_experts * (1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** n)
    return prof.experts_gflops(dt, n * cfg.num_experts_per_tok / touched)     # (rows of a touched expert)


# A MoE state's move between host and GPU (`moe.MoeState.to`: the parts packed into one buffer and copied;
# until session 12 through pageable memory, so the host waited for the copy and for the GPU's queue) at an
# effective rate: 6.3 MB took 1.15 ms a move on the H200 (5.5 GB/s; call ZZ, session 12, a 512-token step
# of the MoE shape at 2 GiB), against 0.12 ms priced at the link's pinned rate. At this rate the estimator
# prices call Z's measured steps of the same code (24 layers): the tier-1024 plan mixing 64 CPU groups into
# the streamed ones 766 / 696 ms at 2 / 4 GiB (437 / 433 predicted before), which streaming every group
# beats (557 / 525); and session 10's tier-64 and tier-256 mixed plans stay ahead of streaming, as call Q
# measured them (288-299 and 438-458 ms against 508-521, 4 GiB). Since session 13 states cross through
# pinned memory (`engine.models.transfer`), which should be faster; not re-measured yet, so this rate stays
# (it can only make the planner shy of mixing CPU and streamed groups, never over-eager).
STATE_MOVE_GBPS = 5.5


def state_move_ms(prof: ProfileDatabase, nbytes: float) -> float:
    """A MoE state of `nbytes` moved between host and GPU, either way (see STATE_MOVE_GBPS)."""
    return prof.link["latency_us"] / 1e3 + nbytes / (STATE_MOVE_GBPS * 1e6)


def step_costs(spec: ModelSpec, prof: ProfileDatabase, n_tokens: int, ctx_len: int,
               head_rows: int | None = 1) -> StepCosts:
    cfg, db, dt = spec.config, spec.dtype_bytes, dtype_name(spec)
    n = max(int(n_tokens), 1)
    ctx = max(int(ctx_len), n)
    rows = n if head_rows is None else min(n, head_rows)
    expert_calls = NATIVE_CALLS_EXPERTS_PER_LAYER / len(cfg.expert_groups()) if cfg.is_moe else 0.0
    sides = ("cpu", "gpu") if prof.has_gpu else ("cpu",)
    ms = {side: np.zeros(len(spec.sublayers)) for side in ("cpu", "gpu")}
    res = {}                    # sub-layer -> its GPU milliseconds where resident, where that differs
    padded = cfg.is_moe and n > FEW_TOKENS and not routed_streaming(cfg, n)
    bulk_rate = cpu_bulk_gflops(prof, dt, cfg, n) if cfg.is_moe and n > 1 else None
    if padded:   # rows of an expert in a padded run: the widest expert's, about the mean + 3 sigma (Poisson)
        mean = n * cfg.num_experts_per_tok / cfg.num_experts
        padded_rows = min(n, mean + 3 * math.sqrt(mean) + 1)
    for i, sub in enumerate(spec.sublayers):
        for side in sides:
            if sub.kind == "embed":
                t = prof.mem_ms(side, 2 * n * cfg.hidden_size * db)
            elif sub.kind == "attn":
                t = sum(attention_parts_ms(prof, side, dt, sub, n, ctx))
            elif sub.kind in ("ffn", "router"):
                t = prof.gemm_ms(side, dt, "ffn", sub.flops_per_token, n)
            elif sub.kind == "experts":
                touched = spec.expected_experts(sub, n)
                rows_per = n * cfg.num_experts_per_tok * sub.n_experts / cfg.num_experts / touched  # >= 1
                t = touched * prof.gemm_ms(side, dt, "ffn", 6 * cfg.hidden_size * cfg.moe_intermediate_size,
                                           rows_per)
                if side == "cpu" and bulk_rate:
                    t = touched * rows_per * 6 * cfg.hidden_size * cfg.moe_intermediate_size / (bulk_rate * 1e6)
                    # the routed pairs' rows through the ops around the jobs (gather, silu and mul, the
                    # weights' scale and cast, the ordered add): memory-bound, size-proportional
                    t += prof.mem_ms("cpu", touched * rows_per * db * (BULK_HIDDEN_PASSES * cfg.hidden_size
                                                                       + BULK_INTER_PASSES * cfg.moe_intermediate_size))
                if side == "gpu" and padded:
                    t = sub.n_experts * prof.gemm_ms(side, dt, "ffn", 6 * cfg.hidden_size
                                                     * cfg.moe_intermediate_size, padded_rows)
            else:
                t = prof.gemm_ms(side, dt, "head", sub.flops_per_token, rows)
            # The CPU pays each op's dispatch in turn; a GPU runs kernels while the host issues more.
            n_ops = OPS[side][sub.kind] + (QK_NORM_OPS[side] if sub.kind == "attn" and cfg.qk_norm else 0)
            if sub.kind == "experts" and side == "gpu" and padded:
                runs = math.ceil(sub.n_experts * padded_rows / n)
                n_ops += runs * OPS_PADDED_RUN + OPS_PADDED_EXPERT * spec.expected_experts(sub, n)
            elif sub.kind == "experts" and side == "cpu" and bulk_rate:
                n_ops += OPS_BULK_GROUP
            elif sub.kind == "experts":
                n_ops += (OPS_PER_EXPERT if n > 1 else OPS_PER_EXPERT_SINGLE) * spec.expected_experts(sub, n)
            issue = prof.op_ms(side, n_ops)
            if side == "cpu":
                calls = (expert_calls if sub.kind == "experts"
                         else NATIVE_CALLS[sub.kind] + (1 if sub.kind == "attn" and cfg.qk_norm else 0))
                issue += calls * prof.native_call_ms
            ms[side][i] = t + issue if side == "cpu" else max(t, issue)
            if side == "gpu" and sub.kind == "experts" and 1 < n <= FEW_TOKENS:
                # (never above the general path's price, which a streamed group pays: more VRAM must not
                # predict worse; the two differ by a few launches where few experts are routed)
                one_call = max(sub.n_experts * prof.gemm_ms(side, dt, "ffn", 6 * cfg.hidden_size
                                                            * cfg.moe_intermediate_size, n),
                               prof.op_ms(side, OPS["gpu"]["experts"] + OPS_ONE_CALL_GROUP))
                if one_call < ms[side][i]:
                    res[i] = one_call
    if not prof.has_gpu:   # any GPU placement costs infinity (crossings stay finite: 0 x inf is nan)
        ms["gpu"][:] = np.inf
        return StepCosts(ms["gpu"], ms["cpu"], np.zeros(len(spec.sublayers)), 0.0, 0.0)
    hidden_bytes = n * cfg.hidden_size * db
    to_gpu = np.full(len(spec.sublayers), prof.move_ms(hidden_bytes, True))
    to_gpu[0] = prof.move_ms(n * 8, True)
    move_to_cpu = prof.move_ms(hidden_bytes, False)
    to_cpu = move_to_cpu + prof.cpu_wake_ms     # and the CPU's matmul threads wake up after GPU work
    extra = None
    if cfg.is_moe:
        # Into an expert group: the MoE state (three hidden-sized tensors and the sorted routing).
        state_bytes = 3 * hidden_bytes + n * cfg.num_experts_per_tok * 12
        is_exp = np.array([s.kind == "experts" for s in spec.sublayers])
        to_gpu[is_exp] = state_move_ms(prof, state_bytes)
        extra = np.where(is_exp, state_move_ms(prof, state_bytes) - move_to_cpu, 0.0)
    routed = routed_copies(spec, prof, n) if routed_streaming(cfg, n) else (None, None, None)
    kv_bytes = np.array([(ctx + n) * s.kv_bytes_per_token if s.kind == "attn" else 0 for s in spec.sublayers],
                        dtype=float)
    kv_alone = np.array([prof.copy_ms(b) if b else 0.0 for b in kv_bytes])
    kv_busy = np.array([prof.copy_ms(b, busy=True) if b else 0.0 for b in kv_bytes])
    gpu_res = None
    if res:
        gpu_res = ms["gpu"].copy()
        gpu_res[list(res)] = list(res.values())
    share_ms, share_frac = share_costs(spec, prof, n)
    return StepCosts(ms["gpu"], ms["cpu"], to_gpu, to_cpu, prof.move_ms(rows * cfg.vocab_size * 4, False),
                     prof.op_ms("gpu", 2), extra, *routed, kv_alone, kv_busy, gpu_res, share_ms, share_frac)


# A streamed FFN's CPU share (`dense.ffn_hidden` on the host rows): the norm, the two row-sliced matmuls and
# silu times up, as native calls and the ops around them; then the join on the GPU (the move, a cat).
SHARE_NATIVE_CALLS = 4
SHARE_CPU_OPS = 4


def share_costs(spec: ModelSpec, prof: ProfileDatabase, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(host ms of all of each dense FFN's gate/up rows on the CPU in a step of `n` tokens, the
    fraction of its packed bytes those rows are) per sub-layer; (None, None) for a model without dense FFNs."""
    cfg, dt = spec.config, dtype_name(spec)
    idx = [i for i, s in enumerate(spec.sublayers) if s.kind == "ffn"]
    if not idx or not prof.has_gpu:
        return None, None
    sizes = sublayer_bytes(spec)
    cpu_ms = np.zeros(len(spec.sublayers))
    frac = np.zeros(len(spec.sublayers))
    gu_bytes = 2 * cfg.intermediate_size * cfg.hidden_size * spec.dtype_bytes
    for i in idx:
        sub = spec.sublayers[i]
        gu_flops = sub.flops_per_token * 2 / 3
        cpu_ms[i] = (prof.gemm_ms("cpu", dt, "ffn", gu_flops, n) + prof.op_ms("cpu", SHARE_CPU_OPS)
                     + SHARE_NATIVE_CALLS * prof.native_call_ms
                     + prof.move_ms(n * cfg.intermediate_size * spec.dtype_bytes, True))
        frac[i] = min(1.0, gu_bytes / sizes[sub.name])
    return cpu_ms, frac


def routed_copies(spec: ModelSpec, prof: ProfileDatabase, n_tokens: int):
    """(copy ms alone [S], copy ms beside CPU work [S], gate [S]) of a step of `n_tokens` with routed
    expert streaming: an expert group copies its expected touched experts' packed bytes, after its router."""
    sizes = sublayer_bytes(spec)
    idx = {s.name: i for i, s in enumerate(spec.sublayers)}
    nb = np.array([sizes[s.name] for s in spec.sublayers], dtype=float)
    gate = np.full(len(spec.sublayers), -1, dtype=np.int64)
    for i, s in enumerate(spec.sublayers):
        if s.kind == "experts":
            nb[i] *= spec.expected_experts(s, n_tokens) / s.n_experts
            gate[i] = idx[f"layers.{s.layer}.ffn"]
    return (np.array([prof.copy_ms(b) for b in nb]), np.array([prof.copy_ms(b, busy=True) for b in nb]), gate)


def copy_costs(spec: ModelSpec, prof: ProfileDatabase) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds to stream each sub-layer's weights: (copy engine alone, beside CPU work)."""
    if not prof.has_gpu:
        inf = np.full(len(spec.sublayers), np.inf)
        return inf, inf
    sizes = transfer_bytes(spec)          # (a transfer-coded sub-layer moves its coded bytes)
    nb = np.array([sizes[s.name] for s in spec.sublayers], dtype=float)
    return np.array([prof.copy_ms(b) for b in nb]), np.array([prof.copy_ms(b, busy=True) for b in nb])


class Estimator:
    """Prices placements of one model on one profile; caches the per-(tokens, context) cost tables."""

    def __init__(self, spec: ModelSpec, prof: ProfileDatabase, head_rows: int | None = 1):
        self.spec, self.prof, self.head_rows = spec, prof, head_rows
        self.names = [s.name for s in spec.sublayers]
        self.compute_mask = np.array([s.kind != "embed" for s in spec.sublayers])
        # per MoE layer: its router's index and its expert groups' indices
        index = {n: i for i, n in enumerate(self.names)}
        self._moe_layers = [(index[f"layers.{j}.ffn"],
                             [i for i, s in enumerate(spec.sublayers) if s.kind == "experts" and s.layer == j])
                            for j in range(spec.config.num_layers)
                            if spec.config.is_moe and spec.config.is_moe_layer(j) and f"layers.{j}.ffn" in index]
        self.copy_alone, self.copy_busy = copy_costs(spec, prof)
        self.rho = prof.cpu_with_copy_factor
        self._costs: dict[tuple[int, int], StepCosts] = {}

    def costs(self, n_tokens: int, ctx_len: int) -> StepCosts:
        key = (int(n_tokens), int(ctx_len))
        if key not in self._costs:
            self._costs[key] = step_costs(self.spec, self.prof, key[0], key[1], self.head_rows)
        return self._costs[key]

    def encode(self, placement: dict[str, Placement], kv_layers: int | None = None) -> np.ndarray:
        """Placement codes; with `kv_layers`, a GPU attention of a layer past them is HKV (its KV cache
        stays in host memory)."""
        codes = np.array([CODE[Placement(placement[n])] for n in self.names], dtype=np.int8)
        if kv_layers is not None:
            for i, s in enumerate(self.spec.sublayers):
                if s.kind == "attn" and s.layer >= kv_layers and codes[i] != CPU:
                    codes[i] = HKV
        return codes

    def pipeline(self, place: np.ndarray, n_slots: int) -> Pipeline:
        """The schedule structure of many placements ([B, S] codes), to run under several step costs."""
        return Pipeline(place, self.copy_alone, self.copy_busy, self.compute_mask, n_slots)

    def partial_moe_layers(self, place: np.ndarray) -> np.ndarray:
        """[B]: how many MoE layers each row keeps partly in VRAM: some expert group resident, but not the
        router and every group (see PARTIAL_MOE_LAYER_MS)."""
        out = np.zeros(len(place), dtype=np.int64)
        for router, groups in self._moe_layers:
            res = place[:, groups] == RES
            out += res.any(1) & ~(res.all(1) & (place[:, router] == RES))
        return out

    def mixed_layer_ms(self, place: np.ndarray, n_tokens: int) -> np.ndarray:
        """[B]: what the step's layers partly in VRAM cost beyond their sub-layers' prices."""
        if n_tokens > FEW_TOKENS or not self._moe_layers:
            return np.zeros(len(place))
        return self.partial_moe_layers(place) * PARTIAL_MOE_LAYER_MS

    def simulate(self, place: np.ndarray, n_tokens: int, ctx_len: int, n_slots: int,
                 share: float = 0.0) -> np.ndarray:
        """Milliseconds per steady-state step of every row of `place` ([B, S] codes); `share`: the fraction
        of each streamed dense FFN's gate/up rows computed on the CPU."""
        return (self.pipeline(place, n_slots).run(self.costs(n_tokens, ctx_len), self.rho, share)
                + self.mixed_layer_ms(place, n_tokens))

    def estimate(self, placement: dict[str, Placement], n_tokens: int, ctx_len: int,
                 n_slots: int = 2, kv_layers: int | None = None, ffn_cpu_rows: int = 0) -> float:
        """Predicted milliseconds of one steady-state step of `n_tokens` new tokens over `ctx_len` context
        (`ffn_cpu_rows`: of each streamed dense FFN's intermediate rows, those computed on the CPU)."""
        share = ffn_cpu_rows / self.spec.config.intermediate_size if ffn_cpu_rows else 0.0
        return float(self.simulate(self.encode(placement, kv_layers)[None, :], n_tokens, ctx_len, n_slots,
                                   share)[0])
