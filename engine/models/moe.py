"""The mixture-of-experts FFN (qwen3_moe, mixtral) as two kinds of sub-layer over a `MoeState`.

`router_block` (the `layers.{i}.ffn` sub-layer of a MoE layer) normalises the residual stream, scores
the experts and picks each token's top k; it returns a `MoeState` that carries the layer through its
expert groups. `experts_block` (one `layers.{i}.experts.{g}` sub-layer) runs the experts of one group on
the tokens routed to them: the routing is sorted by expert once, so each expert gathers its rows, runs
one SwiGLU over them and adds its weighted output back with `index_add_`. `finish` adds the sum of all
experts to the residual stream. Each block runs wherever its weights and the state are, so the executor
can place the router and every group independently; `MoeState.to` moves the state between devices.

Routing follows transformers: softmax over all experts in float32, top k (on the CPU ties go to the
lower expert), renormalised to sum to 1 where `norm_topk_prob` (always for mixtral, whose
top-k-then-softmax is the same function); qwen3_moe casts the weights to the model's dtype before use,
mixtral applies them in float32. A router stored wider than the activations (GGUF files keep it in F32)
scores the experts at its own precision. Experts run in ascending order and their outputs are summed into a
zero tensor before the residual add, as in transformers, so every placement sums in the same order and
gives the same result. On the CPU, a step of up to 16 tokens whose layer is all there runs as one native
call (`layer_cpu`), with the same bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate, compress
from operator import ne

import numpy as np
import torch
import torch.nn.functional as F

from engine import kernels
from engine.config import MOE_FEW_TOKENS, ModelConfig
from engine.models.dense import linear, rms_norm
from engine.models.transfer import packed_move


@dataclass(slots=True)
class MoeState:
    """A MoE layer between its router and its last expert group."""
    x: torch.Tensor          # residual stream [n, hidden]
    h: torch.Tensor          # normalised input of the experts [n, hidden]
    out: torch.Tensor | None  # sum of the expert outputs so far [n, hidden]; None: zero (no expert added yet)
    rows: torch.Tensor       # token row of each (token, expert) pair, sorted by expert [n * k]
    weights: torch.Tensor    # routing weight of each pair, in the same order [n * k]
    bounds: list[int]        # pairs of expert e are rows[bounds[e]:bounds[e + 1]] (host list)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def to(self, device, wait=None) -> MoeState:
        """The state on `device`, its tensors moved in one packed copy (`transfer.packed_move`; `wait`: see
        there) (a sum still zero is not moved: it is made where the first expert adds to it)."""
        device = torch.device(device)
        if self.x.device == device or (device.index is None and self.x.device.type == device.type):
            return self
        parts = [self.x, self.h, self.rows, self.weights] + ([] if self.out is None else [self.out])
        moved = packed_move(parts, device, wait)
        return MoeState(moved[0], moved[1], moved[4] if self.out is not None else None, moved[2], moved[3],
                        self.bounds)


def _sum(s: MoeState) -> torch.Tensor:
    """`s.out`, made (zeros) where it is first needed."""
    if s.out is None:
        s.out = torch.zeros_like(s.h)
    return s.out


def route(cfg: ModelConfig, logits: torch.Tensor,
          dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, top-k expert ids) [n, k] of router logits [n, E], as transformers computes them;
    qwen3_moe's weights in `dtype` (the activations' dtype; default the logits'). A step of up to
    `kernels.MOE_MAX_T` tokens on the CPU is routed natively (`kernels.moe_route`): the CPU layer call
    routes with the same code, so a layer gives the same bits whichever way it runs."""
    if logits.device.type == "cpu" and logits.shape[0] <= kernels.MOE_MAX_T and cfg.arch != "mixtral":
        done = kernels.moe_route(logits, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), dtype or logits.dtype)
        if done is not None:
            return done
    probs = torch.softmax(logits.float(), dim=-1)
    if probs.device.type == "cpu":
        # (a stable descending sort, not topk: of experts whose probabilities tie, the lower index is
        # picked first, as the native routing picks them; 16-bit router logits tie often, and topk's order
        # among ties depends on its algorithm. The GPU keeps topk, which its measured runs used)
        top_w, top_i = torch.sort(probs, dim=-1, descending=True, stable=True)
        top_w, top_i = top_w[..., :cfg.num_experts_per_tok], top_i[..., :cfg.num_experts_per_tok]
    else:
        top_w, top_i = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
    if cfg.norm_topk_prob or cfg.arch == "mixtral":
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    if cfg.arch != "mixtral":
        top_w = top_w.to(dtype or logits.dtype)
    return top_w, top_i


def router_block(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor, sync=None,
                 host: bool = False) -> MoeState:
    """Norm, router and top-k of a MoE layer. `sync()`, when given, is called before the per-expert
    counts are read back to the host (a non-spinning wait for the GPU). `host`: return the state on the
    CPU (the next expert group runs there), the counts read back in the same copy as the state."""
    h = rms_norm(x, w["ffn_norm.weight"], cfg.rms_norm_eps)
    top_w, top_i = route(cfg, router_logits(w["router.weight"], h), h.dtype)
    if host and x.device.type != "cpu":
        # The state goes to the host anyway: the top k come with it in one copy and are sorted there. On a
        # GPU the sort and the count are a dozen launches, one of them (bincount) a sync of its own, for a
        # few dozen integers; the same stable sort and counts on the CPU give the same state.
        x, h, top_w, top_i = packed_move([x, h, top_w, top_i], "cpu", sync)
    rows, weights, ends = _sorted_pairs(cfg, top_w, top_i)
    if sync is not None and x.device.type != "cpu":
        sync()
    return MoeState(x, h, None, rows, weights, [0, *(ends if isinstance(ends, list) else ends.tolist())])


def router_logits(router: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The router's scores of `h`, at the router's precision. A step of up to `kernels.MOE_MAX_T` tokens on
    the CPU takes the native matmul whatever the router's size, as the CPU layer call (`layer_cpu`) scores
    them, so the two agree to the bit (and PyTorch's one-row 16-bit matmul took 0.3-0.5 ms for a 128 x 2048
    router in a decode step, session 7)."""
    hr = h.to(router.dtype)
    if h.device.type == "cpu" and h.shape[0] <= kernels.MOE_MAX_T:
        y = kernels.linear(hr, router, min_weights=0, rows=kernels.MOE_MAX_T)
        if y is not None:
            return y
    return linear(hr, router)


def _sorted_pairs(cfg: ModelConfig, top_w: torch.Tensor, top_i: torch.Tensor):
    """(token row, weight) of every (token, expert) pair sorted by expert (stable), and each expert's end
    in that order (a tensor where the pairs are, or a host list)."""
    if top_i.shape[0] == 1 and top_i.device.type == "cpu":
        # One token on the host (decode): its k experts are distinct, so sorting them in Python gives the
        # same order as the stable sort, without the five small tensor ops of the general path.
        ids = top_i[0].tolist()
        order = sorted(range(len(ids)), key=ids.__getitem__)
        counts = [0] * cfg.num_experts
        for e in ids:
            counts[e] += 1
        return torch.zeros(len(ids), dtype=torch.long), top_w[0, order], list(accumulate(counts))
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ends = torch.cumsum(torch.bincount(flat, minlength=cfg.num_experts), 0)
    return order // cfg.num_experts_per_tok, top_w.reshape(-1)[order], ends


def experts_block(cfg: ModelConfig, w: dict[str, torch.Tensor], s: MoeState, experts: range) -> MoeState:
    """Add the weighted outputs of `experts` (the group whose stacked weights are `w`) for the tokens
    routed to them into `s.out`."""
    return experts_blocks(cfg, [(w, experts)], s)


def experts_blocks(cfg: ModelConfig, parts: list[tuple[dict[str, torch.Tensor], range]], s: MoeState) -> MoeState:
    """`experts_block` over several groups of one layer (the executor passes the consecutive groups that
    run on the CPU together), experts in ascending order.

    On the CPU, where every routed expert has at most `kernels.max_rows_many` tokens (decode, batches),
    the routed experts' matmuls go to the native kernel as one pool job per projection (`_experts_decode`,
    `_experts_batch`; `linear_many` where the groups are not consecutive):
    expert matrices are too small for a pool wake-up each, and PyTorch's few-row bf16 path reaches a
    fraction of DRAM speed. Otherwise each expert runs alone: a one-token step (decode) skips the gather
    and the scatter (the expert reads the token's row as is and adds its weighted output in one fused
    multiply-add: 5 kernels per routed expert instead of 7; on a GPU decode is bound by kernel launches,
    as the host must wait for the router first)."""
    if s.h.device.type == "cpu" and _experts_native(cfg, parts, s):
        return s
    single = s.h.shape[0] == 1
    for w, experts in parts:
        for j, e in enumerate(experts):
            a, b = s.bounds[e], s.bounds[e + 1]
            if a == b:
                continue
            _add_expert(s, a, b, _expert(w, j, s.h if single else s.h[s.rows[a:b]]), single)
    return s


def _expert(w: dict[str, torch.Tensor], j: int, hx: torch.Tensor) -> torch.Tensor:
    """Expert j of the group whose stacked weights are `w`, over rows `hx`, through PyTorch."""
    gate_up = w.get("experts.gate_up.weight")
    if gate_up is not None:
        gate, up = linear(hx, gate_up[j]).chunk(2, dim=-1)
    else:
        gate, up = linear(hx, w["experts.gate.weight"][j]), linear(hx, w["experts.up.weight"][j])
    return linear(F.silu(gate) * up, w["experts.down.weight"][j])


def experts_padded(cfg: ModelConfig, w: dict[str, torch.Tensor], s: MoeState, experts: range) -> MoeState:
    """`experts_block` for a step of many tokens on the GPU (more than `FEW_TOKENS`; every expert of the
    group held whole): the routed experts run in runs of consecutive experts, each run one padded batch
    (each expert's rows gathered, then padding up to the run's widest) through two batched matmuls over the
    group's stacked weights as they are (no copy); then each expert's weighted rows are added in ascending
    expert order, one `index_add_` each, as `experts_block` adds them. A run's padded rows stay within the
    step's token count, so its temporaries stay within the scratch booked for one expert over every row.
    About a dozen launches per run and one per routed expert, where `experts_block` takes seven per routed
    expert: at 256 tokens the launches of a Qwen3-30B-A3B group (1.9 ms on an H200) had cost more than
    its copy over PCIe, so a step could not mix CPU and streamed groups to advantage."""
    b, n_tok = s.bounds, s.h.shape[0]
    counts = [b[e + 1] - b[e] for e in experts]
    runs: list[tuple[int, int, int]] = []          # (first expert, end, rows per expert)
    j, n = 0, len(experts)
    while j < n:
        if not counts[j]:
            j += 1
            continue
        j0, cap = j, counts[j]
        j += 1
        while j < n and (j - j0 + 1) * max(cap, counts[j]) <= n_tok:
            cap = max(cap, counts[j])
            j += 1
        while not counts[j - 1]:                  # (a run ends at a routed expert)
            j -= 1
        runs.append((j0, j, cap))
    if not runs:
        return s
    parts = []                                    # each run's pair rows, padded with the expert's first
    for j0, j1, cap in runs:
        first = np.asarray(b[experts.start + j0:experts.start + j1], dtype=np.int64)[:, None]
        r = np.arange(cap, dtype=np.int64)[None, :]
        parts.append((first + np.where(r < np.asarray(counts[j0:j1])[:, None], r, 0)).reshape(-1))
    at_all = torch.from_numpy(np.concatenate(parts))
    if s.h.is_cuda:                               # (one copy per group, queued: the host does not wait)
        at_all = at_all.pin_memory().to(s.h.device, non_blocking=True)
    out = _sum(s)
    start = 0
    for j0, j1, cap in runs:
        at = at_all[start:start + (j1 - j0) * cap]
        start += (j1 - j0) * cap
        hx = s.h.index_select(0, s.rows.index_select(0, at)).view(j1 - j0, cap, -1)
        if "experts.gate_up.weight" in w:
            gate, up = torch.bmm(hx, w["experts.gate_up.weight"][j0:j1].transpose(1, 2)).chunk(2, dim=-1)
        else:
            gate = torch.bmm(hx, w["experts.gate.weight"][j0:j1].transpose(1, 2))
            up = torch.bmm(hx, w["experts.up.weight"][j0:j1].transpose(1, 2))
        y = torch.bmm(F.silu(gate) * up, w["experts.down.weight"][j0:j1].transpose(1, 2))   # [run, cap, hidden]
        y = (y * s.weights.index_select(0, at).view(j1 - j0, cap, 1)).to(out.dtype)
        for jj in range(j0, j1):
            if counts[jj]:
                a = b[experts.start + jj]
                out.index_add_(0, s.rows[a:a + counts[jj]], y[jj - j0, :counts[jj]])
    return s


def _add_expert(s: MoeState, a: int, b: int, y: torch.Tensor, single: bool) -> None:
    if single:
        _sum(s).addcmul_(y, s.weights[a:b, None])
    else:
        out = _sum(s)
        out.index_add_(0, s.rows[a:b], (y * s.weights[a:b, None]).to(out.dtype))


def _experts_native(cfg: ModelConfig, parts, s: MoeState) -> bool:
    """The routed experts of `parts` through the native kernel (one token: `_experts_decode`; more:
    `_experts_batch`, else `kernels.linear_many` expert by expert); False (nothing done) where it does not
    apply."""
    if s.h.shape[0] == 1:
        done = _experts_decode(parts, s)
        if done is not None:
            return done
    elif _BULK:
        done = _experts_batch(parts, s)
        if done is not None:
            return done
    routed = [(w, j, s.bounds[e], s.bounds[e + 1]) for w, experts in parts for j, e in enumerate(experts)
              if s.bounds[e + 1] > s.bounds[e]]
    if not routed or any(b - a > kernels.max_rows_many(s.h.dtype) for _, _, a, b in routed):
        return not routed
    single = s.h.shape[0] == 1
    hxs = [s.h if single else s.h[s.rows[a:b]] for _, _, a, b in routed]
    if "experts.gate_up.weight" in routed[0][0]:
        gu = kernels.linear_many(hxs, [w["experts.gate_up.weight"][j] for w, j, _, _ in routed])
        if gu is None:
            return False
        gate, up = gu.chunk(2, dim=-1)
    else:
        gu = kernels.linear_many(hxs + hxs, [w[f"experts.{p}.weight"][j] for p in ("gate", "up")
                                             for w, j, _, _ in routed])
        if gu is None:
            return False
        gate, up = gu.chunk(2, dim=0)
    act = F.silu(gate) * up                                       # [routed rows, intermediate]
    counts = [b - a for _, _, a, b in routed]
    acts = list(act.split(counts))
    y = kernels.linear_many(acts, [w["experts.down.weight"][j] for w, j, _, _ in routed])
    if y is None:
        return False
    for (_, _, a, b), yi in zip(routed, y.split(counts)):
        _add_expert(s, a, b, yi, single)
    return True


# False (SLIPSTREAM_MOE_CPU_BULK=0, for A/B runs): a batch's step takes the per-expert `linear_many` path
_BULK = os.environ.get("SLIPSTREAM_MOE_CPU_BULK", "1") != "0"


def _experts_batch(parts, s: MoeState) -> bool | None:
    """`_experts_native` for a step of several tokens (a batch's decode, a short prompt) whose groups are
    consecutive: a fixed number of tensor ops, whatever the number of routed experts. The routed pairs'
    rows are gathered once (they are sorted by expert), each projection is one native job over the
    experts picked from the groups' stacks with their row counts (`kernels.linear_stacked`), and the
    weighted outputs are added pair by pair in that order in one native call (`kernels.scatter_add`), so
    each token's outputs go into the sum in ascending expert order, one rounding each, as one `index_add_`
    per expert adds them (PyTorch's one `index_add_` over all the pairs would not: it sums a row's repeated
    16-bit additions at a wider precision). The per-expert path took about six tensor ops per routed
    expert (a batch of 16 routes to about 80 of a Qwen3-30B-A3B layer's 128). True: done; None: the
    kernel does not apply here (nothing done)."""
    b = s.bounds
    picks: list[tuple[int, int]] = []
    counts: list[int] = []
    for g, (_, experts) in enumerate(parts):
        if g and experts.start != parts[g - 1][1].stop:
            return None
        e0 = experts.start
        for e in experts:
            c = b[e + 1] - b[e]
            if c:
                picks.append((g, e - e0))
                counts.append(c)
    if not picks:
        return True
    if max(counts) > kernels.max_rows_stacked(s.h.dtype):
        return None
    out = _sum(s)
    ws = [w for w, _ in parts]
    at = b[parts[0][1].start]
    first = 0
    while first < len(picks):          # pieces of at most BULK_ROWS pairs (a long prompt's temporaries)
        last, rows_n = first + 1, counts[first]
        while last < len(picks) and rows_n + counts[last] <= BULK_ROWS:
            rows_n += counts[last]
            last += 1
        if not _bulk_piece(ws, picks[first:last], counts[first:last], s, at, at + rows_n, out):
            if not first:
                return None
            a = at                     # (a later piece the kernel did not take: its experts one by one)
            for (g, j), c in zip(picks[first:last], counts[first:last]):
                _add_expert(s, a, a + c, _expert(ws[g], j, s.h[s.rows[a:a + c]]), False)
                a += c
        at += rows_n
        first = last
    return True


BULK_ROWS = 8192    # routed pairs per native job of `_experts_batch` (a 4096-token prompt routes 32k per layer)


def _bulk_piece(ws, picks, counts, s: MoeState, lo: int, hi: int, out: torch.Tensor) -> bool:
    """Pairs lo .. hi-1 (sorted by expert: the picks' rows, `counts` each) through the native jobs, their
    weighted outputs added into `out`; False (nothing done) where the kernel does not apply."""
    rows = s.rows[lo:hi]
    hx = s.h.index_select(0, rows)
    if "experts.gate_up.weight" in ws[0]:
        gu = kernels.linear_stacked(hx, [w["experts.gate_up.weight"] for w in ws], picks, counts=counts)
        if gu is None:
            return False
        gate, up = gu.chunk(2, dim=-1)
    else:
        n = len(ws)
        gu = kernels.linear_stacked(torch.cat([hx, hx]), [w[f"experts.{p}.weight"] for p in ("gate", "up")
                                                          for w in ws],
                                    picks + [(g + n, j) for g, j in picks], counts=counts + counts)
        if gu is None:
            return False
        gate, up = gu.chunk(2, dim=0)
    y = kernels.linear_stacked(F.silu(gate) * up, [w["experts.down.weight"] for w in ws], picks, counts=counts)
    if y is None:
        return False
    yw = (y * s.weights[lo:hi, None]).to(out.dtype)
    if not kernels.scatter_add(out, rows, yw):
        at = 0
        for c in counts:                # (one index_add_ per expert, as the per-expert path adds them)
            out.index_add_(0, rows[at:at + c], yw[at:at + c])
            at += c
    return True


def _experts_decode(parts, s: MoeState) -> bool | None:
    """`_experts_native` for one token (decode): the routed experts' matrices picked from the groups'
    stacks by index (`kernels.linear_stacked`, no tensor per expert), their weighted outputs added to the
    sum in one native call (`kernels.weighted_sum`, the same rounding steps as one `addcmul_` per expert).
    True: done; None: the kernel does not apply here (nothing done)."""
    b = s.bounds
    picks: list[tuple[int, int]] = []
    for g, (_, experts) in enumerate(parts):
        e0, e1 = experts.start, experts.stop
        picks += [(g, e - e0) for e in compress(experts, map(ne, b[e0 + 1:e1 + 1], b[e0:e1]))]
    if not picks:
        return True
    ws = [w for w, _ in parts]
    if "experts.gate_up.weight" in ws[0]:
        gu = kernels.linear_stacked(s.h, [w["experts.gate_up.weight"] for w in ws], picks)
        if gu is None:
            return None
        gate, up = gu.chunk(2, dim=-1)
    else:
        n = len(parts)
        gu = kernels.linear_stacked(s.h, [w[f"experts.{p}.weight"] for p in ("gate", "up") for w in ws],
                                    picks + [(g + n, j) for g, j in picks])
        if gu is None:
            return None
        gate, up = gu.chunk(2, dim=0)
    y = kernels.linear_stacked(F.silu(gate) * up, [w["experts.down.weight"] for w in ws], picks)
    if y is None:
        return None
    a = b[parts[0][1].start]               # one token: its pairs with these experts are a .. a + len(picks)
    weights = s.weights[a:a + len(picks)]
    fresh = s.out is None
    out = torch.empty_like(s.h) if fresh else s.out
    if kernels.weighted_sum(out, y, weights, from_zero=fresh):
        s.out = out
    else:                                  # (float32 weights: one addcmul_ each, as before)
        for i in range(len(picks)):
            _add_expert(s, a + i, a + i + 1, y[i:i + 1], True)
    return True


FEW_TOKENS = MOE_FEW_TOKENS   # a MoE layer held in one place runs whole (`layer_few_tokens`) up to here


def layer_few_tokens(cfg: ModelConfig, router_w: dict[str, torch.Tensor],
                     groups: list[tuple[dict[str, torch.Tensor], range]], x: torch.Tensor) -> torch.Tensor:
    """A whole MoE layer (router, every expert group, the residual add) for a step of a few tokens
    (x [t, hidden], t up to `FEW_TOKENS`) whose experts are all in one place, with no value read back to the
    host: a GPU step queues it without waiting for the router (the general path reads the per-expert
    counts back first, then launches each routed expert's kernels), and the graphs can capture it.

    Each group runs all of its experts over the step's tokens (batched matmuls over the group's stacked
    gate/up and down weights, the tokens as columns) and keeps each token's rows of the experts routed to
    it; each token's k outputs are then added to a zero sum in ascending expert order, one rounding each,
    as the general path adds a token's. Reading a whole group costs VRAM bandwidth at any token count (1.2
    GB per Qwen3-30B-A3B layer, about 0.3 ms on an H200): a decode step's general path took 1.1-2.0 ms of
    host time per layer, this one 0.53-0.58 (session 9, call J); a batch of 16 touches about 80 of the 128
    experts, each with its own launches, on the general path."""
    h = rms_norm(x, router_w["ffn_norm.weight"], cfg.rms_norm_eps)
    router = router_w["router.weight"]
    top_w, top_i = route(cfg, router_logits(router, h), h.dtype)
    ids, order = torch.sort(top_i, dim=1)                  # each token's k routed experts, ascending
    weights = top_w.gather(1, order)
    t, k = ids.shape
    tokens = torch.arange(t, device=h.device).unsqueeze(1)
    ys = torch.zeros(t, k, h.shape[1], dtype=h.dtype, device=h.device)
    for w, experts in groups:
        n = len(experts)
        local = ids - experts.start
        inside = ((local >= 0) & (local < n)).unsqueeze(2)
        pick = local.clamp(0, n - 1)
        # (batched matmuls over the stacked views as they are: a group's buffer holds each expert's
        # gate, up and down together, so a stack is not one matrix, and reshaping it would copy it)
        hs = h.t().unsqueeze(0).expand(n, -1, -1)                                 # [n, hidden, t]
        gate_up = w.get("experts.gate_up.weight")
        if gate_up is not None:
            gate, up = torch.bmm(gate_up, hs).chunk(2, dim=1)
        else:
            gate, up = torch.bmm(w["experts.gate.weight"], hs), torch.bmm(w["experts.up.weight"], hs)
        y = torch.bmm(w["experts.down.weight"], F.silu(gate) * up)                # [n, hidden, t]
        ys = torch.where(inside, y.permute(2, 0, 1)[tokens, pick], ys)            # [t, k, hidden]
    out = torch.zeros_like(h)
    for r in range(k):
        out.addcmul_(ys[:, r], weights[:, r:r + 1])
    return x + out


def expert_table(cfg: ModelConfig, groups: list[tuple[dict[str, torch.Tensor], range]]) -> kernels.ExpertTable | None:
    """The addresses of a layer's expert matrices for `layer_cpu` (`kernels.ExpertTable`), or None
    where the groups do not cover the layer's experts in order or their stacks do not suit the native call.
    Valid while the groups' tensors live (the executor keeps one per layer)."""
    at = 0
    for w, r in groups:
        if r.start != at or "experts.down.weight" not in w or w["experts.down.weight"].shape[0] != len(r):
            return None
        at = r.stop
    if at != cfg.num_experts or not groups:
        return None
    return kernels.expert_table([w for w, _ in groups])


def layer_cpu(cfg: ModelConfig, router_w: dict[str, torch.Tensor],
              groups: list[tuple[dict[str, torch.Tensor], range]], x: torch.Tensor,
              table: kernels.ExpertTable | None = None) -> torch.Tensor | None:
    """A whole MoE layer for a step of up to `kernels.MOE_MAX_T` tokens (decode, a batch of streams) whose
    router and every expert group are on the CPU, as one native call (`kernels.moe_layer`), with the steps
    and roundings of `router_block`, `experts_blocks` and `finish` and the same bits (the router's matmul and
    the routing on the CPU are the same C functions either way): the tensor path spends a dozen PyTorch ops
    and five library calls a layer around the experts' matmuls. On the H200 host the one-token call decoded
    the Qwen3-30B-A3B shape (24 layers) 1.29-1.46x faster than the tensor path at 2-8 GiB, alternating in
    one engine (session 14, `engine.bench.moe_layer_ab`; the tensor path's routing was PyTorch's then).
    `table`: the layer's `expert_table`, where the caller keeps one. Returns the residual stream after the
    layer, or None (nothing done) where it does not apply: more tokens, mixtral's float32 routing weights,
    groups that do not cover the experts in order, no native kernel."""
    if not 0 < x.shape[0] <= kernels.MOE_MAX_T or x.device.type != "cpu" or cfg.arch == "mixtral":
        return None
    if table is None:
        table = expert_table(cfg, groups)
        if table is None:
            return None
    return kernels.moe_layer(x.contiguous(), router_w["ffn_norm.weight"], cfg.rms_norm_eps, router_w["router.weight"],
                             cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), table)


def finish(s: MoeState) -> torch.Tensor:
    """The residual stream after the MoE layer."""
    return s.x + _sum(s)
