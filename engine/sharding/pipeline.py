"""Replays the executor's schedule of one step for many placements at once (numpy, one row each).

The model:
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
- the step ends with the output (logits) back on the host;
- a streamed attention whose layer keeps its KV cache in host memory (code HKV) copies that KV in with its
  weights and its new keys and values back out (`StepCosts.kv_copy_alone_ms` / `kv_copy_busy_ms`);
- in steps with routed expert streaming (`StepCosts.copy_gate`), the copy of a streamed expert group
  cannot start before its layer's router has computed in the same step (the executor learns which
  experts to copy from it), and costs only the routed experts' bytes (`StepCosts.copy_alone_ms` /
  `copy_busy_ms`); such a copy holds back the copies queued behind it, as the executor's queue does;
- with a share (`run(..., share)`), a streamed dense FFN copies only the head of its gate/up rows
  (`StepCosts.share_copy_frac` of its bytes times the share come off its copy) and the host computes the
  tail (`StepCosts.share_cpu_ms` times the share, at the CPU-while-copying rate where copies are in
  flight) from the hidden state on the host, as soon as that is there; the GPU part starts when both the
  slot's copy and the host's rows are in.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from engine.sharding.estimator import StepCosts

CPU, RES, STR, HKV = 0, 1, 2, 3   # placement codes of a row; HKV: a streamed attention whose layer keeps
                                  # its KV cache in host memory (its copy also brings that KV in)


class Pipeline:
    """The schedule structure of B placements ([B, S] codes CPU/RES/STR/HKV); `run(costs, rho)` replays it.

    `compute_mask` marks sub-layers whose CPU placement is real compute (not the embedding gather);
    `copy_alone` / `copy_busy` are each sub-layer's copy time alone and beside CPU work. Arrays run
    [sub-layer, row] so each sub-layer touches contiguous data."""

    def __init__(self, place: np.ndarray, copy_alone: np.ndarray, copy_busy: np.ndarray,
                 compute_mask: np.ndarray, n_slots: int):
        pt = np.ascontiguousarray(np.asarray(place, dtype=np.int8).T)          # [S, B]
        self.S, self.B = S, B = pt.shape
        self.n_slots = max(int(n_slots), 1)
        self.on_gpu = on_gpu = pt != CPU
        is_str = (pt == STR) | (pt == HKV)
        self.n_str = n_str = is_str.sum(0)
        self.ordn = ordn = np.cumsum(is_str, 0, dtype=np.int64) - 1
        self.smax = smax = max(int(n_str.max()) if B else 0, 1)
        sidx = np.zeros((smax, B), dtype=np.int64)
        r, c = np.nonzero(is_str)
        sidx[ordn[r, c], c] = r
        self.mixed = is_str.any(0) & ((pt == CPU) & compute_mask[:, None]).any(0)
        self.sidx = sidx                                                      # [smax, B] sub-layer
        # [smax, B]: the row's g-th streamed sub-layer brings its layer's KV along (padding: False)
        self.hkv = (pt == HKV)[sidx, np.arange(B)[None, :]] & (np.arange(smax)[:, None] < n_str[None, :])
        self.ctab = self._ctab(copy_alone, copy_busy)
        self.cycles = n_str > self.n_slots
        self.n_copies = np.where(self.cycles, 2 * n_str + self.n_slots, n_str)
        self.safe_nstr = np.maximum(n_str, 1)
        self.str_rows = [np.nonzero(is_str[i])[0] for i in range(S)]
        self.is_str = is_str
        self.is_res = pt == RES
        self.uniform = [(bool(on_gpu[i].all()), not bool(on_gpu[i].any())) for i in range(S)]

    def with_slots(self, n_slots: int) -> Pipeline:
        """The same schedule structure streaming through `n_slots` slots (what depends on the slot count
        made again; the rest shared)."""
        other = copy.copy(self)
        other.n_slots = max(int(n_slots), 1)
        other.cycles = self.n_str > other.n_slots
        other.n_copies = np.where(other.cycles, 2 * self.n_str + other.n_slots, self.n_str)
        return other

    def _ctab(self, copy_alone: np.ndarray, copy_busy: np.ndarray) -> np.ndarray:
        """Flat [smax, B] copy time of each row's streamed sub-layers in order."""
        return np.where(self.mixed[None, :], copy_busy[self.sidx], copy_alone[self.sidx]).reshape(-1)

    def run(self, costs: StepCosts, rho: float, share: float | np.ndarray = 0.0) -> np.ndarray:
        """Steady-state milliseconds per step of each row under one set of step costs; `share` (one for
        all rows, or [B]): the fraction of each streamed dense FFN's gate/up rows computed on the host."""
        S, B, n_slots, smax = self.S, self.B, self.n_slots, self.smax
        on_gpu, n_str, ordn, ctab, cycles = self.on_gpu, self.n_str, self.ordn, self.ctab, self.cycles
        if costs.copy_alone_ms is not None:
            ctab = self._ctab(costs.copy_alone_ms, costs.copy_busy_ms)
        if costs.kv_copy_alone_ms is not None and self.hkv.any():
            ctab = ctab + np.where(self.hkv.reshape(-1), self._ctab(costs.kv_copy_alone_ms, costs.kv_copy_busy_ms), 0.0)
        pre_ms = None
        share = np.broadcast_to(np.asarray(share, dtype=float), (B,))
        if costs.share_cpu_ms is not None and (share > 0).any():
            ctab = ctab * (1.0 - share[None, :] * costs.share_copy_frac[self.sidx]).reshape(-1)
            pre_ms = costs.share_cpu_ms
        gres = costs.gpu_res_ms
        gate = costs.copy_gate
        if gate is not None:
            # Per row's streamed no.: the router it waits for (-1: none); its end time per step.
            gtab = np.where(np.arange(smax)[:, None] < n_str[None, :], gate[self.sidx], -1).reshape(-1)
            g_end = np.zeros(2 * smax * B)
            gated_by = [np.nonzero(gate == i)[0] for i in range(S)]
            gate_rows = [np.nonzero(self.is_str[g].any(0))[0] if len(g) else None for g in gated_by]
        pos = 0                                         # sub-layers computed so far (steps x S + i)
        n_copies, safe_nstr, str_rows, uniform = self.n_copies, self.safe_nstr, self.str_rows, self.uniform
        cend = np.zeros((2 * smax + n_slots) * B)       # flat [Q, B]: end of copy q of row b at q * B + b
        e_str = np.zeros(2 * smax * B)                  # flat [2 smax, B]: compute end of streamed no. g
        qs = np.zeros(B, dtype=np.int64)                # copies scheduled so far
        done = np.zeros(B, dtype=np.int64)              # streamed sub-layers computed so far
        last = np.zeros(B)                              # end of the last scheduled copy
        w_busy = 1.0 - rho

        def schedule(rows: np.ndarray) -> None:
            """Issue every copy that `rows` may start now (only rows whose `done` just grew can)."""
            b = rows
            while True:
                b = b[qs[b] < np.minimum(done[b] + n_slots, n_copies[b])]
                if not len(b):
                    return
                q = qs[b]
                start = np.zeros(len(b))
                if gate is not None:                    # a routed copy waits for its router
                    gq, sq = q % safe_nstr[b], q // safe_nstr[b]
                    gi = gtab[gq * B + b]
                    known = (gi < 0) | (sq * S + gi < pos)
                    b, q, gq, sq, gi = b[known], q[known], gq[known], sq[known], gi[known]
                    if not len(b):
                        return
                    start = np.where(gi >= 0, g_end[np.minimum(sq * smax + gq, 2 * smax - 1) * B + b], 0.0)
                prev = np.where(q > 0, cend[np.maximum(q - 1, 0) * B + b], 0.0)
                dep = np.where(q >= n_slots, e_str[np.maximum(q - n_slots, 0) * B + b], 0.0)
                end = np.maximum(np.maximum(prev, dep), start) + ctab[(q % safe_nstr[b]) * B + b]
                cend[q * B + b] = end
                last[b] = end
                qs[b] += 1

        to_cpu = np.full(S, costs.to_cpu_ms)
        if costs.to_cpu_extra_ms is not None:
            to_cpu = to_cpu + costs.to_cpu_extra_ms
        t = np.zeros(B)
        prev_gpu = np.zeros(B, dtype=bool)
        ends = []
        for step in (0, 1):
            if step == 0 and len(str_rows) and any(len(x) for x in str_rows):
                schedule(np.arange(B))
            for i in range(S):
                g = on_gpu[i]
                all_gpu, all_cpu = uniform[i]
                changed = g ^ prev_gpu
                ready = t + (changed & g) * costs.to_gpu_ms[i] + (changed & ~g) * to_cpu[i]
                rows = str_rows[i]
                if len(rows):
                    gord = step * n_str[rows] + ordn[i, rows]
                    q = np.where(cycles[rows], gord, ordn[i, rows])
                    if pre_ms is not None and pre_ms[i] > 0:
                        # the host's rows, from the hidden state on the host (brought back if it was not)
                        host = t[rows] + (prev_gpu[rows] & (share[rows] > 0)) * to_cpu[i]
                        w = pre_ms[i] * share[rows]
                        busy = np.maximum(last[rows] - host, 0.0)
                        ready[rows] = np.maximum(ready[rows], host + (np.minimum(w / rho, w + w_busy * busy)
                                                                      if rho < 1 else w))
                    ready[rows] = np.maximum(ready[rows], cend[q * B + rows])
                d_gpu = costs.gpu_ms[i]
                if gres is not None and gres[i] != d_gpu:
                    d_gpu = np.where(self.is_res[i], gres[i], d_gpu)
                if all_gpu:
                    e = ready + d_gpu
                else:
                    w = costs.cpu_ms[i]
                    busy = np.maximum(last - ready, 0.0)       # copies in flight from `ready` on
                    d_cpu = np.minimum(w / rho, w + w_busy * busy) if rho < 1 else w
                    e = ready + d_cpu if all_cpu else ready + np.where(g, d_gpu, d_cpu)
                pos += 1
                if len(rows):
                    e[rows] += costs.stream_ms
                    e_str[gord * B + rows] = e[rows]
                    done[rows] += 1
                    schedule(rows)
                if gate is not None and gate_rows[i] is not None and len(gate_rows[i]):
                    for j in gated_by[i]:               # the router's groups may copy from its end on
                        jr = self.str_rows[j]
                        g_end[(step * smax + ordn[j, jr]) * B + jr] = e[jr] + costs.stream_ms
                    schedule(gate_rows[i])
                t = e
                prev_gpu = g
            t = t + prev_gpu * costs.out_ms
            prev_gpu = np.zeros(B, dtype=bool)
            ends.append(t.copy())
        return ends[1] - ends[0]
