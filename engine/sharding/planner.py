"""The planner: for a VRAM budget, one plan per token tier, chosen by the estimator from a fixed family.

The family (`Family`) is every placement described by four numbers, independent of the budget:
- k, how many layers keep their KV cache in VRAM (the first k; their attention runs on the GPU);
- r, how long a prefix of the priority order is resident. The order is: GPU attention (layer order), then
  the FFNs front to back (so whole layers become resident);
- m, how many of the non-resident FFNs stream into slots (spread evenly, so each copy overlaps the CPU
  work between two streamed FFNs); the other FFNs run on the CPU;
- the output head: resident, streamed or on the CPU (a separate choice: it is as large as several FFNs,
  so "head before FFNs" and "FFNs before head" are both in the family);
- for k up to a quarter of the layers of a dense model: whether the attention of the layers past k runs
  on the CPU or streams to the GPU over its KV cache, which stays in host memory either way (each such
  step copies that layer's KV in and its new keys and values out: dear for decode, cheap beside a long
  prompt's compute, so prefill tiers of small budgets, where the KV of every layer does not fit, take it;
  tiers below HKV_MIN_TIER never do).
GPU attention that is not resident streams. The embedding (a gather of a few rows) stays in host memory,
except in forced gpu_only plans, which put every sub-layer on the GPU. Kinds, by placement (the embedding
gather does not count as CPU compute): `gpu_only` computes nothing on the CPU (non-resident sub-layers
stream), `static` streams nothing (resident by priority, the rest on the CPU), `dynamic` does both.

Mixture-of-experts models: the units that become resident or stream after attention are the expert
groups (and the dense FFNs of layers without experts), front to back; a MoE layer's router is resident
whenever its attention runs on the GPU and on the CPU otherwise (it is tiny, and the hidden state is
then already where it runs), and each member comes again with the router of every GPU-attention layer
whose expert groups all run on the CPU moved there too (one hidden state crosses instead of the MoE
state; the estimator picks). So the static plan keeps attention and the head resident with the experts on
the CPU, and dynamic plans stream expert groups. As a MoE model has many more units than layers, r runs
over a geometric ladder (steps of at most ~15%) of attention layers up to k and then of units past it,
and m over powers of two, which keeps the planning time within a few times a dense model's.

Each member's VRAM (`engine.sharding.memory`) and predicted time per tier (`engine.sharding.estimator`)
are computed once per KV capacity (about a second for an 8B model); a plan is then a lookup of the
fastest member under the budget, per tier (about a millisecond). All tiers of a PlanSet share k (the KV
cache of the first k layers lives in VRAM, the others' in host memory, so no KV moves between tiers) and
whether the head is resident: the pair whose plans minimise `score`, the predicted time of a reference workload (decode
steps and one input per tier). (With `split_small` the tiers up to SPLIT_TIER tokens choose their pair
apart from the larger tiers', the KV and head moves at each switch priced; planning the MoE shape then
takes about 20 ms instead of 4.) Resident sets of the tiers are then nested (prefixes of one order, and
the same head), so switching tiers only adds or drops a tail; MoE routers are apart (a router may run on
the host beside its layer's CPU experts in one tier and on the GPU in another: half a megabyte each).

Because the family does not depend on the budget, more budget never predicts a worse PlanSet score, nor
a slower plan for a tier while the shared choices stay; budget 0 always has the all-CPU plan (0 bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from engine.errors import BadInputError, BudgetError
from engine.sharding.estimator import CPU, HKV, RES, STR, Estimator
from engine.sharding.memory import (
    kv_cache_bytes,
    scratch_bytes,
    stage_ring_bytes,
    sublayer_bytes,
    vram_breakdown,
)
from engine.sharding.plan import DEFAULT_TIERS, PLAN_KINDS, Placement, Plan, PlanSet
from engine.sharding.profile import ProfileDatabase
from engine.sharding.spec import ModelSpec
from engine.units import format_bytes, parse_bytes

_PLACEMENT = {CPU: Placement.CPU, RES: Placement.RESIDENT, STR: Placement.STREAMED, HKV: Placement.STREAMED}
REFERENCE_DECODE = 256   # decode steps in the reference workload that `score` prices
# With `split_small`, tiers up to this many tokens (decode, a few streams) may share k and the head's
# residency among themselves instead of with the larger tiers, the KV and head moves at each switch priced
# (`Planner._split_cost`). 4, not 16: with tier 16 in the small group the H200 profile predicted slower
# 16-token steps (MoE 2 GiB 184.1 against 169.8 ms, Llama 8 GiB 126.6 against 108.7) for the same one-token
# plans; with it among the large tiers, 169.8 and 101.3.
SPLIT_TIER = 4
# Tiers whose plans may stream through one slot instead of the planner's `n_slots`, where the pipeline prices
# that faster by more than ONE_SLOT_MIN_GAIN (`Planner(one_slot_tiers=ONE_SLOT_TIERS)`) and the steps that share
# the decode plan (up to ONE_SLOT_CHECK_TOKENS) no slower. In a decode step the CPU's sub-layers between two
# streamed ones give the copy engine its time anyway, so the second slot buys little and its VRAM could hold
# one more sub-layer resident: with raw bf16 streams the H200 profile prices the Llama-3-8B decode at 4 / 8 GiB
# 1.4 / 1.9% faster (95.3 / 65.7 ms against 96.7 / 67.0; `engine.bench.one_slot_plans`). Off by default
# (`Planner` and the engine plan two slots everywhere; SLIPSTREAM_ONE_SLOT_DECODE=1 or
# `TorchEngine.one_slot_decode(True)` allows one): with transfer coding, which the engine uses wherever host
# memory allows, the same profile never prices one slot faster (`one_slot_plans --transfer-ratio 0.7529`),
# and on the H200 (session 27, call BX) the engine planned the same two-slot decode either way (96.9 / 67.9
# ms at 4 / 8 GiB), so it had nothing to measure.
ONE_SLOT_TIERS = (1,)
ONE_SLOT_MIN_GAIN = 0.005
ONE_SLOT_CHECK_TOKENS = 16    # the engine runs steps of up to this many tokens on the decode plan (SMALL_STEP)
_M_STEPS = (*range(17), 20, 24, 28, 32, 45, 64, 90, 128)   # streamed FFN counts tried (one FFN moves a
# decode step's balance between the CPU and the copy engine by several milliseconds: fine steps where it counts)
# Attention over host-resident KV only for steps of at least this many tokens: each such layer's copies
# and gathers cost the host thread (which also runs the CPU sub-layers) about a millisecond that the
# estimator does not price, which a decode step cannot afford (H200, 4 GiB: 121 ms predicted, 208 run)
HKV_MIN_TIER = 16
# A CPU share of the streamed dense FFNs' rows (`Plan.ffn_cpu_rows`, with `Planner(ffn_share=True)`): the
# shares tried (j / SHARE_STEPS of the rows, j = 1..SHARE_STEPS, in multiples of SHARE_ROW_ALIGN rows), taken
# where predicted faster by more than SHARE_MIN_GAIN (the estimator's noise between near-equal schedules must
# not flip plans). The estimator prices the host's rows far below what they cost on the H200 host (session 20,
# call Q, Llama-3-8B at 4 GiB): 1792 rows of one FFN took 0.67 ms alone (44 GB/s) and added 1.6-2.4 ms of
# host time to each streamed FFN in decode, priced at about 0.4; a 512-token prompt whose tier-1024 plan gave
# the CPU 896 rows ran at 880-1170 tokens/s against 1740-2040 without, predicted 3% faster.
SHARE_STEPS = 16
SHARE_ROW_ALIGN = 16
SHARE_MIN_GAIN = 0.01
_UNIT_LADDER = 0.15     # MoE: relative step of the resident prefix lengths tried
_M_STEPS_MOE = (0, 1, 2, 4, 8, 16, 32, 64, 128)   # streamed unit counts tried for MoE models
_PIPELINE_CELLS = 1 << 22   # members x sub-layers replayed at once (~50 bytes of working memory each)
# ... where a background thread prices a table (`warm` with a pause): smaller blocks, so that the thread
# holds the interpreter for a few milliseconds at a time between its pauses
_PAUSED_CELLS = 1 << 17


def token_tiers(limit: int) -> tuple[int, ...]:
    """The standard tiers (1, 4, 16, 64, 256, 1024, x4 ...) up to `limit`, which is always a tier."""
    limit = max(int(limit), 1)
    tiers, t = [], 1
    while t < limit:
        tiers.append(t)
        t *= 4
    return (*tiers, limit)


def planning_context(tier: int, kv_tokens: int) -> int:
    """Context length a tier's plan is priced at: half the KV capacity (a conversation midway), at
    least the tier itself, at most the capacity."""
    return max(tier, min(kv_tokens, max(kv_tokens // 2, 1)))


def attention_choices(n_layers: int) -> list[int]:
    """Values of k tried: all of 0..L for small models, else 0, L and eighths in between."""
    if n_layers <= 12:
        return list(range(n_layers + 1))
    return sorted({0, n_layers} | {round(j * n_layers / 8) for j in range(1, 8)})


class Family:
    """All member placements ([B, S] codes), their k, kind masks and VRAM parts (tier-independent)."""

    def __init__(self, spec: ModelSpec, n_slots: int):
        subs = spec.sublayers
        idx = {s.name: i for i, s in enumerate(subs)}
        cfg = spec.config
        L = cfg.num_layers
        attn = [idx[f"layers.{j}.attn"] for j in range(L)]
        # The FFN units in priority order: a dense layer's FFN, or a MoE layer's expert groups.
        ffn = [i for i, s in enumerate(subs) if s.kind in ("ffn", "experts")]
        routers = [idx[f"layers.{j}.ffn"] if cfg.is_moe_layer(j) else None for j in range(L)]
        head, embed = idx["head"], idx["embed"]
        groups = {j: [i for i, s in enumerate(subs) if s.name.startswith(f"layers.{j}.experts.")] for j in range(L)}
        layer_ends = tuple(np.cumsum([len(groups[j]) or 1 for j in range(L)]).tolist())   # (units: groups or an FFN)
        blocks, ks = [], []
        for k in attention_choices(L):
            order = attn[:k] + ffn
            r_values = range(len(order) + 1) if not cfg.is_moe else _resident_counts(k, len(ffn), layer_ends)
            for r in r_values:
                base = np.full(len(subs), CPU, dtype=np.int8)
                base[attn[:k]] = STR
                base[[x for x in routers[:k] if x is not None]] = RES
                base[order[:r]] = RES
                rows = self._ffn_patterns(base, [f for f in ffn if base[f] != RES],
                                          _M_STEPS_MOE if cfg.is_moe else _M_STEPS)
                if cfg.is_moe and k:
                    rows = self._with_host_routers(rows, routers[:k], groups)
                if k <= L // 4 and not cfg.is_moe:   # small budgets (few layers' KV in VRAM): the same with
                    # the later layers' attention streamed over their host-resident KV (a few k: planning time)
                    hkv = rows.copy()
                    hkv[:, attn[k:]] = HKV
                    rows = np.concatenate([rows, hkv])
                for head_at, head_rows in ((CPU, rows), (RES, rows), (STR, rows)):
                    head_rows = head_rows.copy()
                    head_rows[:, head] = head_at
                    blocks.append(head_rows)
                    ks.append(np.full(len(head_rows), k))
        place, k_of = np.concatenate(blocks), np.concatenate(ks)
        compute = np.array([s.kind != "embed" for s in subs])
        # Forced gpu_only plans also keep the embedding on the GPU: copies of the members that compute
        # nothing on the CPU, with the embedding resident. Other plans gather embeddings on the CPU.
        all_gpu = ((place == CPU) & compute).sum(1) == 0
        extra = place[all_gpu].copy()
        extra[:, embed] = RES
        self.place = np.concatenate([place, extra])
        self.k = np.concatenate([k_of, k_of[all_gpu]])
        # Members are grouped by what all tiers of a PlanSet share: k, and whether the head is resident.
        self.group = self.k * 2 + (self.place[:, head] == RES)
        embed_res = np.arange(len(self.place)) >= len(place)
        n_cpu = ((self.place == CPU) & compute).sum(1)
        streams = (self.place == STR) | (self.place == HKV)
        self.n_str = n_str = streams.sum(1)
        self.n_ffn_str = (streams & np.array([s.kind == "ffn" for s in subs])[None, :]).sum(1)
        self.hkv = (self.place == HKV).any(1)
        self.masks = {"auto": ~embed_res, "gpu_only": embed_res, "static": ~embed_res & (n_str == 0),
                      "dynamic": ~embed_res & (n_str > 0) & (n_cpu > 0)}
        self.label = np.where(n_cpu == 0, "gpu_only", np.where(n_str == 0, "static", "dynamic"))
        sizes = sublayer_bytes(spec)
        nb = np.array([sizes[s.name] for s in subs], dtype=np.int64)
        self.weights = ((self.place == RES) * nb).sum(1)
        self._largest_streamed = np.where(streams, nb, 0).max(1)
        self._ring = stage_ring_bytes(spec)
        self.slots = self.slot_bytes(n_slots)
        self.any_gpu = (self.place != CPU).any(1)

    def slot_bytes(self, n_slots: int) -> np.ndarray:
        """[B] VRAM of each member's streaming slots (and the staging ring beside them) with `n_slots`."""
        used = np.minimum(n_slots, self.n_str)
        return used * self._largest_streamed + np.where(used > 0, self._ring, 0)

    @staticmethod
    def _with_host_routers(rows: np.ndarray, routers: list[int | None], groups: dict[int, list[int]]) -> np.ndarray:
        """`rows` and, where they differ, the same rows with the router of every GPU-attention layer whose
        expert groups all run on the CPU moved to the CPU too: the hidden state then crosses to the host
        before the router instead of the MoE state after it, and the host scores the experts itself (a
        small matmul, no GPU launches or sync of its own). The estimator picks between the two."""
        moved = rows.copy()
        for j, r in enumerate(routers):
            if r is None or not groups[j]:
                continue
            host = (rows[:, groups[j]] == CPU).all(1)
            moved[host, r] = CPU
        differ = (moved != rows).any(1)
        return np.concatenate([rows, moved[differ]]) if differ.any() else rows

    @staticmethod
    def _ffn_patterns(base: np.ndarray, free: list[int], m_steps: tuple[int, ...]) -> np.ndarray:
        """One row per m: m of the `free` FFNs streamed, spread evenly (Bresenham), the rest on the CPU."""
        n = len(free)
        ms = sorted({min(m, n) for m in m_steps} | {n})
        rows = np.repeat(base[None, :], len(ms), axis=0)
        if n:
            j = np.arange(n)[None, :]
            m = np.array(ms)[:, None]
            pick = (j + 1) * m // n > j * m // n
            sub = rows[:, free]
            sub[pick] = STR
            rows[:, free] = sub
        return rows


def _ladder(n: int) -> list[int]:
    """0..n: every value up to 8, then values growing by _UNIT_LADDER, then n."""
    out, u = set(range(min(8, n) + 1)), 8
    while u < n:
        out.add(u)
        u = max(u + 1, round(u * (1 + _UNIT_LADDER)))
    out.add(n)
    return sorted(out)


def _resident_counts(k: int, n_units: int, whole: tuple[int, ...] = ()) -> list[int]:
    """Resident prefix lengths tried for a MoE model with k GPU attention layers: a ladder over the
    attention layers, then k plus a ladder over the units and every prefix of whole layers (`whole`: the
    unit counts at layer ends; a layer partly in VRAM runs the slow general path in small steps)."""
    return _ladder(k)[:-1] + [k + u for u in sorted(set(_ladder(n_units)) | set(whole))]


def _round_significant(x: np.ndarray, digits: int) -> np.ndarray:
    finite = np.isfinite(x) & (x > 0)
    exp = np.floor(np.log10(np.where(finite, x, 1.0)))
    scale = 10.0 ** (digits - 1 - exp)
    return np.where(finite, np.round(x * scale) / scale, x)


class _Front:
    """Fastest member at or under each VRAM size, for one (kind, k, tier); among equals the one with
    less VRAM, then the one streaming fewer sub-layers."""

    def __init__(self, members: np.ndarray, vram: np.ndarray, ms: np.ndarray, n_str: np.ndarray):
        order = np.lexsort((n_str, ms, vram))
        self.members, self.vram, ms = members[order], vram[order], ms[order]
        best = np.minimum.accumulate(ms)
        prev = np.concatenate([[np.inf], best[:-1]])
        self.best_pos = np.maximum.accumulate(np.where(ms < prev, np.arange(len(ms)), 0))
        self.best_ms = best

    def lookup(self, budget: int) -> tuple[int, float] | None:
        pos = int(np.searchsorted(self.vram, budget, side="right")) - 1
        if pos < 0:
            return None
        return int(self.members[self.best_pos[pos]]), float(self.best_ms[pos])


def score(tier_ms: list[tuple[int, float]]) -> float:
    """How a PlanSet is judged: the predicted time of a reference workload, REFERENCE_DECODE steps of the
    smallest tier (decoding a reply) plus one input of each larger tier's size, where an input may also
    run as steps of a smaller tier (so its per-token time is the best at or below its tier)."""
    total, per_token = 0.0, math.inf
    for i, (tier, ms) in enumerate(tier_ms):
        per_token = min(per_token, ms / tier)
        total += REFERENCE_DECODE * ms if i == 0 else tier * per_token
    return total


def planset_score(plans: list[Plan]) -> float:
    return score([(p.tier, p.predicted_ms) for p in plans])


def best_step_tokens(plans: list[Plan]) -> int:
    """The tier with the lowest predicted time per token (the smallest among equals)."""
    return min(plans, key=lambda p: (p.predicted_ms / p.tier, p.tier)).tier


KV_LAYERS_ENTRY = "kv_layers"    # the `moved_to_cpu` entry "kv_layers=N"


def parse_move(entry: str) -> tuple[str, Placement | int]:
    """One `Planner.moved_to_cpu` entry: "PATTERN" (computed on the CPU), "PATTERN=PLACE" (PLACE: cpu,
    resident or streamed) -> (pattern, placement); "kv_layers=N" (the GPU-resident KV prefix: N layers,
    at most as many as lead with their attention on the GPU) -> ("kv_layers", N); a one-line error for
    anything else."""
    pat, sep, to = entry.partition("=")
    if not sep:
        return entry, Placement.CPU
    if pat.strip() == KV_LAYERS_ENTRY:
        if not to.strip().isdigit():
            raise BadInputError(f"{entry!r}: expected kv_layers=N with N a number of layers")
        return KV_LAYERS_ENTRY, int(to)
    try:
        return pat, Placement(to.strip().lower())
    except ValueError:
        raise BadInputError(f"{entry!r}: expected PATTERN or PATTERN=PLACE with PLACE one of cpu, resident, "
                            "streamed, or kv_layers=N") from None


class Planner:
    """Plans for one model on one profile: `plan(budget)` -> PlanSet; `estimate(plan, n, ctx)` -> ms."""

    def __init__(self, spec: ModelSpec, prof: ProfileDatabase, tiers: tuple[int, ...] = DEFAULT_TIERS,
                 n_slots: int = 2, head_rows: int | None = 1, split_small: bool = False,
                 ffn_share: bool = False, one_slot_tiers: tuple[int, ...] = ()):
        if not tiers or any(int(t) < 1 for t in tiers):
            raise BadInputError(f"tiers={tiers!r}: expected positive token counts")
        self.spec, self.prof = spec, prof
        self.split_small = split_small
        # plans may give the CPU a share of the streamed dense FFNs' rows (`_with_share`). Off by default: on
        # the H200 (session 20, calls P and Q) every share measured ran slower than without, where the
        # estimator had priced several faster (see SHARE_STEPS)
        self.ffn_share = ffn_share
        self.tiers = tuple(sorted({int(t) for t in tiers}))
        self.n_slots = max(1, int(n_slots))
        # tiers also priced with one slot (`ONE_SLOT_TIERS`): their column of the tables at one slot
        self.one_slot = tuple(i for i, t in enumerate(self.tiers) if t in set(one_slot_tiers)) \
            if self.n_slots > 1 else ()
        self.estimator = Estimator(spec, prof, head_rows)
        self.family = Family(spec, self.n_slots) if prof.has_gpu else None
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._one_slot_tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # [B, len(one_slot)] each
        self._fronts: dict[tuple[int, str, int, int, int], _Front] = {}
        self._shared: dict[tuple[int, int], dict[int, tuple[float, int]]] = {}   # (KV, tier) -> member -> share

    # ---- the estimator -------------------------------------------------------------------------
    def estimate(self, plan: Plan, n_tokens: int, ctx_len: int) -> float:
        """Predicted milliseconds of one steady-state step of `n_tokens` over `ctx_len` under `plan`."""
        return self.estimator.estimate(plan.placement, n_tokens, ctx_len, plan.n_slots, plan.kv_layers,
                                       plan.ffn_cpu_rows)

    # ---- member tables -------------------------------------------------------------------------
    def _table(self, kv_tokens: int, pause: Callable[[], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(vram [B, T], ms [B, T]) of every family member at every tier, for this KV capacity. `pause`:
        called before each block of members is priced at each tier (see `warm`)."""
        if kv_tokens not in self._tables:
            fam = self.family
            kv_layer = kv_cache_bytes(self.spec, kv_tokens, 1)
            scratch = np.array([scratch_bytes(self.spec, t) for t in self.tiers], dtype=np.int64)
            fixed = fam.weights + fam.slots + fam.k * kv_layer + fam.hkv * kv_layer   # (one layer's KV copy)
            vram = fixed[:, None] + fam.any_gpu[:, None] * scratch[None, :]
            est = self.estimator
            costs = [est.costs(t, planning_context(t, kv_tokens)) for t in self.tiers]
            # One schedule structure per block of members, priced per tier (blocks bound the memory of
            # the replay for models with many sub-layers; a dense model's family is one block).
            step = max(256, (_PIPELINE_CELLS if pause is None else _PAUSED_CELLS) // fam.place.shape[1])

            def priced(pipe, c):
                if pause is not None:
                    pause()
                return pipe.run(c, est.rho)
            cols = list(self.one_slot)         # (the tiers also priced with one slot, on the same structure)
            parts, parts1 = [], []
            for a in range(0, len(fam.place), step):
                pipe = est.pipeline(fam.place[a:a + step], self.n_slots)
                parts.append(np.stack([priced(pipe, c) for c in costs], 1))
                if cols:
                    one = pipe.with_slots(1)
                    parts1.append(np.stack([priced(one, costs[ti]) for ti in cols], 1))
            mixed = np.stack([est.mixed_layer_ms(fam.place, t) for t in self.tiers], 1)
            ms = _round_significant(np.concatenate(parts) + mixed, 12)   # equal schedules compare equal
            if cols:                                                     # despite rounding noise
                vram1 = vram[:, cols] - fam.slots[:, None] + fam.slot_bytes(1)[:, None]
                self._one_slot_tables[kv_tokens] = (vram1, _round_significant(np.concatenate(parts1) + mixed[:, cols], 12))
            self._tables[kv_tokens] = (vram, ms)
        return self._tables[kv_tokens]

    def has_table(self, kv_tokens: int) -> bool:
        """Whether plans for this KV capacity are ready (the member tables take about a second to price
        for an 8B model: a budget drop must not wait for them)."""
        return self.family is None or max(int(kv_tokens), 0) in self._tables

    def nearest_table(self, kv_tokens: int) -> int | None:
        """The smallest KV capacity at least `kv_tokens` whose tables are ready: its plans book at least
        the KV this capacity needs, so they fit wherever they say they fit."""
        return min((k for k in list(self._tables) if k >= kv_tokens), default=None)

    def warm(self, kv_tokens: int, pause: Callable[[], None] | None = None) -> None:
        """Price the tables of this KV capacity now (a background thread's job). `pause` is called between
        blocks of a few milliseconds' work: the replay is Python and numpy, which hold the interpreter
        lock, and a thread pricing beside a decode slowed the decode's host work several times over (each
        native call's return waited for the lock), so the engine's pause waits while steps run."""
        if self.family is not None:
            self._table(max(int(kv_tokens), 0), pause)

    def _front(self, kv_tokens: int, kind: str, group: int, ti: int, n_slots: int | None = None) -> _Front | None:
        """The front of tier `ti`'s members of `kind` and `group`, streaming through the planner's slots, or
        (`n_slots` 1, for a tier in `one_slot`) through one."""
        one = n_slots == 1 and self.n_slots > 1
        key = (kv_tokens, kind, group, ti, 1 if one else self.n_slots)
        if key not in self._fronts:
            vram, ms = self._table(kv_tokens)
            col = ti
            if one:
                vram, ms = self._one_slot_tables[kv_tokens]
                col = self.one_slot.index(ti)
            sel = self.family.masks[kind] & (self.family.group == group)
            if self.tiers[ti] < HKV_MIN_TIER:
                sel &= ~self.family.hkv
            members = np.nonzero(sel)[0]
            fam = self.family
            self._fronts[key] = (_Front(members, vram[members, col], ms[members, col], fam.n_str[members])
                                 if len(members) else None)
        return self._fronts[key]

    # ---- planning ------------------------------------------------------------------------------
    def plan(self, budget_bytes: int | str, kv_tokens: int = 4096, force_kind: str | None = None,
             strict: bool = False, tier_reserve: dict[int, int] | None = None) -> PlanSet:
        """One plan per tier within `budget_bytes`. `force_kind` picks the best plan of that kind per tier;
        where none fits, that tier falls back to the best plan of any kind (its `kind` says which), or
        with `strict` a BudgetError names the smallest budget the kind needs. `tier_reserve`: bytes a
        tier's plan leaves free for work of its own (the one-token CUDA graphs: tier 1)."""
        budget = parse_bytes(budget_bytes, "budget")
        tier_reserve = tier_reserve or {}
        budgets = [max(budget - tier_reserve.get(t, 0), 0) for t in self.tiers]
        kind = force_kind or "auto"
        if kind != "auto" and kind not in PLAN_KINDS:
            raise BadInputError(f"plan kind {force_kind!r}: expected one of {', '.join(PLAN_KINDS)}")
        kv_tokens = max(int(kv_tokens), 0)
        if self.family is None:
            return self._all_cpu(budget, kv_tokens, kind, strict)
        # group -> per tier: ((member, ms), of the forced kind, slots) or None; through the planner's slots
        # alone, and with the one-slot tiers' fronts too (taken where faster by more than ONE_SLOT_MIN_GAIN)
        hits: dict[int, list] = {}
        hits_one: dict[int, list] = {}
        for group in np.unique(self.family.group):
            row = hits[int(group)] = []
            row_one = hits_one[int(group)] = []
            for ti in range(len(self.tiers)):
                found = self._hit(kv_tokens, kind, int(group), ti, budgets[ti], self.n_slots)
                row.append(found)
                if ti in self.one_slot and (one := self._hit(kv_tokens, kind, int(group), ti, budgets[ti], 1)) and (
                        found is None or (one[1], -one[0][1]) > (found[1], -found[0][1] * (1 - ONE_SLOT_MIN_GAIN))):
                    found = one
                row_one.append(found)
        best = self._best(hits, kv_tokens)
        if self.one_slot:
            # The one-slot plans where they also run the steps that share the decode plan (up to
            # ONE_SLOT_CHECK_TOKENS: verify steps, small batches) within ONE_SLOT_MIN_GAIN of the two-slot
            # plans: at 2 GiB the H200 profile prices the Llama-3-8B one-slot decode plan 3.5% faster for one
            # token and 8% slower for 16
            alt = self._best(hits_one, kv_tokens)
            if alt is not None and best is not None and alt[0] < best[0]:
                n = ONE_SLOT_CHECK_TOKENS
                small_one = self._member_ms(alt[1][0][0], n, alt[4][0], kv_tokens)
                small_two = self._member_ms(best[1][0][0], n, best[4][0], kv_tokens)
                if small_one <= small_two * (1 + ONE_SLOT_MIN_GAIN):
                    best = alt
        if strict and kind != "auto" and -best[0][0] < len(self.tiers):
            need = format_bytes(self.min_budget(kind, kv_tokens))
            raise BudgetError(f"no {kind} plan fits a VRAM budget of {format_bytes(budget)} for every tier "
                              f"(the {kind} plans need at least {need})")
        small = [ti for ti, t in enumerate(self.tiers) if t <= SPLIT_TIER] if self.split_small else []
        groups = [best[2] if ti in small else best[3] for ti in range(len(self.tiers))]
        plans = [self._make_plan(*(self._with_share(kv_tokens, ti, groups[ti], b, m, ms)
                                   if kind == "auto" and n_slots == self.n_slots else (m, ms, 0)),
                                 tier, kind, kv_tokens, b, n_slots)
                 for ti, ((m, ms), tier, b, n_slots) in enumerate(zip(best[1], self.tiers, budgets, best[4]))]
        return PlanSet(budget, plans, step_tokens=best_step_tokens(plans))

    def _member_ms(self, member: int, n_tokens: int, n_slots: int, kv_tokens: int) -> float:
        """A family member's predicted step of `n_tokens` through `n_slots` slots (as the tables price it)."""
        est, row = self.estimator, self.family.place[member:member + 1]
        costs = est.costs(n_tokens, planning_context(n_tokens, kv_tokens))
        return float(est.pipeline(row, n_slots).run(costs, est.rho)[0] + est.mixed_layer_ms(row, n_tokens)[0])

    def _hit(self, kv_tokens: int, kind: str, group: int, ti: int, budget: int, n_slots: int):
        """((member, ms), of the forced kind, n_slots): the fastest member of `group` at tier `ti` within
        `budget` through `n_slots` slots, of `kind` where one fits, else of any kind; None where none fits."""
        if kind != "auto" and (front := self._front(kv_tokens, kind, group, ti, n_slots)) is not None:
            hit = front.lookup(budget)
            if hit is not None:
                return hit, True, n_slots
        if (front := self._front(kv_tokens, "auto", group, ti, n_slots)) is not None:
            hit = front.lookup(budget)
            if hit is not None:
                return hit, False, n_slots
        return None

    def _best(self, hits: dict[int, list], kv_tokens: int):
        """The best rows of `hits` by (forced kinds met, `score` + split cost): (key, picks, small group,
        large group, slots per tier), or None where no group fits every tier."""
        small = [ti for ti, t in enumerate(self.tiers) if t <= SPLIT_TIER] if self.split_small else []
        best = None
        for g_small in (hits if small else (None,)):
            for g_large in hits:
                row = [hits[g_small][ti] if ti in small else hits[g_large][ti] for ti in range(len(self.tiers))]
                if any(h is None for h in row):
                    continue
                picks = [h for h, _, _ in row]
                cand = (-sum(st for _, st, _ in row),
                        score([(t, ms) for t, (_, ms) in zip(self.tiers, picks)])
                        + self._split_cost(g_small, g_large, kv_tokens))
                if best is None or cand < best[0]:
                    best = (cand, picks, g_small, g_large, [n for _, _, n in row])
        return best

    def _split_cost(self, g_small: int | None, g_large: int, kv_tokens: int) -> float:
        """What `score`'s reference workload pays for small tiers planned in another group than the large
        ones: at each of its inputs, the KV cache of the layers between the two k and the head where its
        residency differs move over PCIe, to the large tiers' plan and back (plan switches move weights
        anyway; these moves come on top)."""
        if g_small is None or g_small == g_large:
            return 0.0
        (k_s, head_s), (k_l, head_l) = divmod(g_small, 2), divmod(g_large, 2)
        moved = kv_cache_bytes(self.spec, kv_tokens, abs(k_s - k_l))
        if head_s != head_l:
            moved += sublayer_bytes(self.spec)["head"]
        n_inputs = sum(1 for t in self.tiers if t > SPLIT_TIER)
        return n_inputs * 2 * self.prof.copy_ms(moved)

    def min_budget(self, kind: str, kv_tokens: int = 4096) -> int:
        """The smallest budget with a plan of `kind` for every tier (0 for "auto": all on the CPU)."""
        if kind == "auto" or self.family is None:
            return 0
        vram, _ = self._table(kv_tokens)
        need = None
        for group in np.unique(self.family.group):
            sel = self.family.masks[kind] & (self.family.group == group)
            if sel.any():
                v = int(vram[sel].min(0).max())
                need = v if need is None else min(need, v)
        return need if need is not None else -1

    def _with_share(self, kv_tokens: int, ti: int, group: int, budget: int, member: int,
                    ms: float) -> tuple[int, float, int]:
        """(member, ms, ffn_cpu_rows): the plan for tier `ti` with a CPU share of the streamed dense FFNs'
        rows (`Plan.ffn_cpu_rows`) where one is predicted faster than `member` without, by more than
        SHARE_MIN_GAIN. The members tried are those of the same group (k and the head's residency, which
        the other tiers share) within the budget, the fastest of each streamed count (a share is worth most
        where more FFNs stream than the CPU/PCIe balance of whole FFNs would stream), at SHARE_STEPS shares
        each: one replay of a few hundred rows."""
        fam, est, cfg = self.family, self.estimator, self.spec.config
        if not self.ffn_share or not any(s.kind == "ffn" for s in self.spec.sublayers):
            return member, ms, 0
        vram, table = self._table(kv_tokens)
        tier = self.tiers[ti]
        sel = fam.masks["auto"] & (fam.group == group) & (vram[:, ti] <= budget) & (fam.n_ffn_str > 0)
        if tier < HKV_MIN_TIER:
            sel &= ~fam.hkv
        cand = np.nonzero(sel)[0]
        if not len(cand):
            return member, ms, 0
        cand = cand[np.lexsort((table[cand, ti], fam.n_ffn_str[cand]))]
        cand = cand[np.r_[True, fam.n_ffn_str[cand][1:] != fam.n_ffn_str[cand][:-1]]]
        known = self._shared.setdefault((kv_tokens, ti), {})
        new = [int(c) for c in cand if int(c) not in known]
        if new:       # (a member's best share does not depend on the budget: priced once per KV capacity)
            inter = cfg.intermediate_size
            rows = sorted({min(inter, max(SHARE_ROW_ALIGN, round(inter * j / SHARE_STEPS / SHARE_ROW_ALIGN)
                                          * SHARE_ROW_ALIGN)) for j in range(1, SHARE_STEPS + 1)})
            share = np.tile(np.array(rows) / inter, len(new))
            ctx = planning_context(tier, kv_tokens)
            got = est.pipeline(np.repeat(fam.place[new], len(rows), 0), self.n_slots).run(
                est.costs(tier, ctx), est.rho, share).reshape(len(new), len(rows))
            for c, r in zip(new, got):
                j = int(np.argmin(r))
                known[c] = (float(r[j]), rows[j])
        best_ms, best_member = min((known[int(c)][0], int(c)) for c in cand)
        if not best_ms < ms * (1 - SHARE_MIN_GAIN):
            return member, ms, 0
        return best_member, best_ms, known[best_member][1]

    def _make_plan(self, member: int, ms: float, ffn_cpu_rows: int, tier: int, kind: str, kv_tokens: int,
                   budget: int, n_slots: int | None = None) -> Plan:
        row = self.family.place[member]
        placement = {s.name: _PLACEMENT[int(c)] for s, c in zip(self.spec.sublayers, row)}
        label = str(self.family.label[member])
        if kind != "auto" and self.family.masks[kind][member]:
            label = kind
        if ffn_cpu_rows:
            label = "dynamic"            # (the CPU computes a share of the streamed FFNs)
        kv_layers = int(self.family.k[member])
        n_slots = self.n_slots if n_slots is None else n_slots
        vram = vram_breakdown(self.spec, placement, tier, kv_tokens, n_slots, kv_layers)
        assert vram.total <= budget, (vram.total, budget)
        return Plan(tier, label, placement, n_slots, ms, vram, kv_tokens, kv_layers, ffn_cpu_rows)

    def moved_to_cpu(self, plan: Plan, patterns: tuple[str, ...]) -> Plan:
        """`plan` with the sub-layers whose names match any of `patterns` (shell-style: "layers.*.attn")
        computed on the CPU instead, or, for an entry "PATTERN=PLACE" (PLACE: cpu, resident or streamed),
        placed there (the first entry whose pattern matches decides), priced by the same estimator: a
        placement the planner did not choose, for benchmarks that set it beside the chosen one. Moves to the
        CPU alone take no more VRAM than `plan`; the caller checks a move to the GPU against its budget
        (`vram.total`). A layer whose attention moves to the CPU
        keeps its KV cache in host memory (the GPU-resident KV prefix ends before it); one whose attention
        moves to the GPU keeps its KV where it was (in host memory past the prefix: copied in each step),
        unless a "kv_layers=N" entry sets the prefix: N layers, capped at the layers that lead with their
        attention on the GPU (so a plan can be set to another plan's placement and KV exactly)."""
        from fnmatch import fnmatchcase

        parsed = [parse_move(p) for p in patterns]
        rules = [(pat, to) for pat, to in parsed if pat != KV_LAYERS_ENTRY]
        kv_set = [to for pat, to in parsed if pat == KV_LAYERS_ENTRY]

        def place(name: str, was: Placement) -> Placement:
            for pat, to in rules:
                if fnmatchcase(name, pat):
                    return to
            return was

        placement = {n: place(n, p) for n, p in plan.placement.items()}
        first_cpu = min([s.layer for s in self.spec.sublayers if s.kind == "attn" and placement[s.name] is Placement.CPU],
                        default=self.spec.config.num_layers)
        kv_layers = plan.kv_layers
        if kv_set:
            kv_layers = min(kv_set[-1], first_cpu)
        elif kv_layers is not None:
            kv_layers = min(kv_layers, first_cpu)
        vram = vram_breakdown(self.spec, placement, plan.tier, plan.kv_tokens, plan.n_slots, kv_layers)
        moved = Plan(plan.tier, "manual", placement, plan.n_slots, float("nan"), vram, plan.kv_tokens, kv_layers)
        moved.predicted_ms = self.estimate(moved, plan.tier, planning_context(plan.tier, plan.kv_tokens))
        return moved

    def with_ffn_rows(self, plan: Plan, rows: int) -> Plan:
        """`plan` with `rows` of each streamed dense FFN's intermediate rows on the CPU (at most all of them),
        priced by the same estimator: a share the planner did not choose, for benchmarks that set it beside
        the chosen one. The VRAM is the same (slots keep a whole FFN's size)."""
        rows = min(max(int(rows), 0), self.spec.config.intermediate_size)
        if not any(plan.placement.get(s.name) is Placement.STREAMED for s in self.spec.sublayers if s.kind == "ffn"):
            rows = 0
        out = Plan(plan.tier, plan.kind if rows == plan.ffn_cpu_rows else "manual", dict(plan.placement),
                   plan.n_slots, plan.predicted_ms, plan.vram, plan.kv_tokens, plan.kv_layers, rows)
        if rows != plan.ffn_cpu_rows:
            out.predicted_ms = self.estimate(out, plan.tier, planning_context(plan.tier, plan.kv_tokens))
        return out

    def _all_cpu(self, budget: int, kv_tokens: int, kind: str, strict: bool) -> PlanSet:
        if strict and kind not in ("auto", "static"):
            raise BudgetError(f"no {kind} plan without a GPU: the profile of {self.prof.device!r} has none")
        placement = {s.name: Placement.CPU for s in self.spec.sublayers}
        plans = []
        for t in self.tiers:
            ms = self.estimator.estimate(placement, t, planning_context(t, kv_tokens), self.n_slots)
            plans.append(Plan(t, "static", dict(placement), self.n_slots, ms,
                              vram_breakdown(self.spec, placement, t, kv_tokens, self.n_slots), kv_tokens))
        return PlanSet(budget, plans, step_tokens=best_step_tokens(plans))
