"""The roofline estimator: predicted milliseconds per step of a placement, modelling the executor's pipeline.

Per sub-layer costs come from the profile (`StepCosts`): matmuls from the measured GFLOP/s tables,
attention over the context from KV bytes read and FLOPs, a per-kernel overhead, activation moves between
CPU and GPU (bytes over PCIe plus a fixed latency) wherever consecutive sub-layers change sides.

`simulate` then replays the executor's schedule for many placements at once (numpy, one row each):
- sub-layers run in order (embed, layers.0.attn, layers.0.ffn, ..., head), each starting when the previous
  one has finished, its input has crossed over if the side changed, and (if streamed) its weights arrived
  (a streamed sub-layer also costs the host two kernel launches' worth of work for its copy and wait);
- the copy engine copies streamed sub-layers in order, one at a time, each into a free slot; a slot frees
  when the sub-layer that used it (n_slots streamed sub-layers earlier) finishes; with no more streamed
  sub-layers than slots, each keeps its slot and is copied once, not every step;
- prefetch runs on across the step boundary (the executor loads the next step's first streamed sub-layers
  as soon as slots free), so two steps are replayed and the second one, the steady state, is reported;
- CPU sub-layers run at the profile's "CPU while copying" rate while a copy is in flight (copies that can
  be in flight during a CPU sub-layer are exactly those whose slots were already free when it started, so
  they form one busy interval from its start), and copies run at the "copy beside CPU work" bandwidth in
  plans that mix streamed and CPU sub-layers;
- the step ends with the output (logits) back on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.sharding.memory import sublayer_bytes
from engine.sharding.plan import Placement
from engine.sharding.profile import ProfileDatabase
from engine.sharding.spec import DTYPE_BYTES, ModelSpec

CPU, RES, STR = 0, 1, 2
CODE = {Placement.CPU: CPU, Placement.RESIDENT: RES, Placement.STREAMED: STR}
OPS = {"embed": 1, "attn": 14, "ffn": 7, "head": 3}   # kernels per sub-layer (per-op overhead)


@dataclass(frozen=True)
class StepCosts:
    """Milliseconds of each sub-layer for one (n_tokens, ctx_len), on each side, and of the crossings."""
    gpu_ms: np.ndarray        # [S]
    cpu_ms: np.ndarray        # [S]
    to_gpu_ms: np.ndarray     # [S] moving sub-layer i's input to the GPU (token ids for i = 0)
    to_cpu_ms: float          # moving the hidden state to the host
    out_ms: float             # logits back to the host when the last sub-layer ran on the GPU
    stream_ms: float = 0.0    # host work per streamed sub-layer (issue its copy, order compute after it)


def dtype_name(spec: ModelSpec) -> str:
    if DTYPE_BYTES.get(spec.config.dtype) == spec.dtype_bytes:
        return spec.config.dtype
    return "float32" if spec.dtype_bytes == 4 else "bfloat16"


def step_costs(spec: ModelSpec, prof: ProfileDatabase, n_tokens: int, ctx_len: int,
               head_rows: int | None = 1) -> StepCosts:
    cfg, db, dt = spec.config, spec.dtype_bytes, dtype_name(spec)
    n = max(int(n_tokens), 1)
    ctx = max(int(ctx_len), n)
    rows = n if head_rows is None else min(n, head_rows)
    sides = ("cpu", "gpu") if prof.has_gpu else ("cpu",)
    ms = {side: np.zeros(len(spec.sublayers)) for side in ("cpu", "gpu")}
    for i, sub in enumerate(spec.sublayers):
        for side in sides:
            if sub.kind == "embed":
                t = prof.mem_ms(side, 2 * n * cfg.hidden_size * db)
            elif sub.kind == "attn":
                t = (prof.gemm_ms(side, dt, "attn", sub.flops_per_token, n)
                     + prof.attention_ms(side, dt, ctx * sub.kv_bytes_per_token,
                                         n * ctx * sub.attn_flops_per_token_ctx))
            elif sub.kind == "ffn":
                t = prof.gemm_ms(side, dt, "ffn", sub.flops_per_token, n)
            else:
                t = prof.gemm_ms(side, dt, "head", sub.flops_per_token, rows)
            ms[side][i] = t + prof.op_ms(side, OPS[sub.kind])
    if not prof.has_gpu:   # any GPU placement costs infinity (crossings stay finite: 0 x inf is nan)
        ms["gpu"][:] = np.inf
        return StepCosts(ms["gpu"], ms["cpu"], np.zeros(len(spec.sublayers)), 0.0, 0.0)
    hidden_bytes = n * cfg.hidden_size * db
    to_gpu = np.full(len(spec.sublayers), prof.move_ms(hidden_bytes, True))
    to_gpu[0] = prof.move_ms(n * 8, True)
    return StepCosts(ms["gpu"], ms["cpu"], to_gpu, prof.move_ms(hidden_bytes, False),
                     prof.move_ms(rows * cfg.vocab_size * 4, False), prof.op_ms("gpu", 2))


def copy_costs(spec: ModelSpec, prof: ProfileDatabase) -> tuple[np.ndarray, np.ndarray]:
    """Milliseconds to stream each sub-layer's weights: (copy engine alone, beside CPU work)."""
    if not prof.has_gpu:
        inf = np.full(len(spec.sublayers), np.inf)
        return inf, inf
    sizes = sublayer_bytes(spec)
    nb = np.array([sizes[s.name] for s in spec.sublayers], dtype=float)
    return np.array([prof.copy_ms(b) for b in nb]), np.array([prof.copy_ms(b, busy=True) for b in nb])


def simulate(place: np.ndarray, costs: StepCosts, copy_alone: np.ndarray, copy_busy: np.ndarray,
             compute_mask: np.ndarray, rho: float, n_slots: int) -> np.ndarray:
    """Steady-state milliseconds per step of each row of `place` ([B, S] codes CPU/RES/STR) under one set
    of step costs. `compute_mask` marks sub-layers whose CPU placement is real compute (not the embedding
    gather). Arrays run [sub-layer, row] so each sub-layer touches contiguous data."""
    pt = np.ascontiguousarray(np.asarray(place, dtype=np.int8).T)          # [S, B]
    S, B = pt.shape
    n_slots = max(int(n_slots), 1)
    on_gpu = pt != CPU
    is_str = pt == STR
    n_str = is_str.sum(0)
    ordn = np.cumsum(is_str, 0, dtype=np.int64) - 1
    smax = max(int(n_str.max()) if B else 0, 1)
    sidx = np.zeros((smax, B), dtype=np.int64)
    r, c = np.nonzero(is_str)
    sidx[ordn[r, c], c] = r
    mixed = is_str.any(0) & ((pt == CPU) & compute_mask[:, None]).any(0)
    ctab = np.where(mixed[None, :], copy_busy[sidx], copy_alone[sidx]).reshape(-1)   # flat [smax, B]
    del sidx
    cycles = n_str > n_slots
    n_copies = np.where(cycles, 2 * n_str + n_slots, n_str)
    safe_nstr = np.maximum(n_str, 1)
    cend = np.zeros((2 * smax + n_slots) * B)       # flat [Q, B]: end of copy q of row b at q * B + b
    e_str = np.zeros(2 * smax * B)                  # flat [2 smax, B]: compute end of streamed ordinal g
    qs = np.zeros(B, dtype=np.int64)                # copies scheduled so far
    done = np.zeros(B, dtype=np.int64)              # streamed sub-layers computed so far
    last = np.zeros(B)                              # end of the last scheduled copy
    str_rows = [np.nonzero(is_str[i])[0] for i in range(S)]
    uniform = [(bool(on_gpu[i].all()), not bool(on_gpu[i].any())) for i in range(S)]
    w_busy = 1.0 - rho

    def schedule() -> None:
        while True:
            b = np.nonzero(qs < np.minimum(done + n_slots, n_copies))[0]
            if not len(b):
                return
            q = qs[b]
            prev = np.where(q > 0, cend[np.maximum(q - 1, 0) * B + b], 0.0)
            dep = np.where(q >= n_slots, e_str[np.maximum(q - n_slots, 0) * B + b], 0.0)
            end = np.maximum(prev, dep) + ctab[(q % safe_nstr[b]) * B + b]
            cend[q * B + b] = end
            last[b] = end
            qs[b] += 1

    t = np.zeros(B)
    prev_gpu = np.zeros(B, dtype=bool)
    ends = []
    for step in (0, 1):
        if step == 0 and len(str_rows) and any(len(x) for x in str_rows):
            schedule()
        for i in range(S):
            g = on_gpu[i]
            all_gpu, all_cpu = uniform[i]
            changed = g ^ prev_gpu
            ready = t + (changed & g) * costs.to_gpu_ms[i] + (changed & ~g) * costs.to_cpu_ms
            rows = str_rows[i]
            if len(rows):
                gord = step * n_str[rows] + ordn[i, rows]
                q = np.where(cycles[rows], gord, ordn[i, rows])
                ready[rows] = np.maximum(ready[rows], cend[q * B + rows])
            if all_gpu:
                e = ready + costs.gpu_ms[i]
            else:
                w = costs.cpu_ms[i]
                d_cpu = np.minimum(w / rho, w + w_busy * np.maximum(last - ready, 0.0)) if rho < 1 else w
                e = ready + d_cpu if all_cpu else ready + np.where(g, costs.gpu_ms[i], d_cpu)
            if len(rows):
                e[rows] += costs.stream_ms
                e_str[gord * B + rows] = e[rows]
                done[rows] += 1
                schedule()
            t = e
            prev_gpu = g
        t = t + prev_gpu * costs.out_ms
        prev_gpu = np.zeros(B, dtype=bool)
        ends.append(t.copy())
    return ends[1] - ends[0]


class Estimator:
    """Prices placements of one model on one profile; caches the per-(tokens, context) cost tables."""

    def __init__(self, spec: ModelSpec, prof: ProfileDatabase, head_rows: int | None = 1):
        self.spec, self.prof, self.head_rows = spec, prof, head_rows
        self.names = [s.name for s in spec.sublayers]
        self.compute_mask = np.array([s.kind != "embed" for s in spec.sublayers])
        self.copy_alone, self.copy_busy = copy_costs(spec, prof)
        self.rho = prof.cpu_with_copy_factor
        self._costs: dict[tuple[int, int], StepCosts] = {}

    def costs(self, n_tokens: int, ctx_len: int) -> StepCosts:
        key = (int(n_tokens), int(ctx_len))
        if key not in self._costs:
            self._costs[key] = step_costs(self.spec, self.prof, key[0], key[1], self.head_rows)
        return self._costs[key]

    def encode(self, placement: dict[str, Placement]) -> np.ndarray:
        return np.array([CODE[Placement(placement[n])] for n in self.names], dtype=np.int8)

    def simulate(self, place: np.ndarray, n_tokens: int, ctx_len: int, n_slots: int) -> np.ndarray:
        """Milliseconds per steady-state step of every row of `place` ([B, S] codes)."""
        return simulate(place, self.costs(n_tokens, ctx_len), self.copy_alone, self.copy_busy,
                        self.compute_mask, self.rho, n_slots)

    def estimate(self, placement: dict[str, Placement], n_tokens: int, ctx_len: int,
                 n_slots: int = 2) -> float:
        """Predicted milliseconds of one steady-state step of `n_tokens` new tokens over `ctx_len` context."""
        return float(self.simulate(self.encode(placement)[None, :], n_tokens, ctx_len, n_slots)[0])
