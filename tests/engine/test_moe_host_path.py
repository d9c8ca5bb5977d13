"""The MoE decode path's host-side shortcuts give the same bits as the paths they replace.

- `kernels.weighted_sum` equals one `addcmul_` per expert, in order (bf16 and fp16, a zero, non-zero or
  `from_zero` start, lengths that are and are not a multiple of the vector width);
- `kernels.linear_stacked` (experts picked from strided stacks by index) equals `kernels.linear_many` over
  the same experts' matrices;
- a decode step through `_experts_decode` gives the logits of the `linear_many` path (the one before it)
  to the bit on the CPU: qwen3_moe in float32 (summed by PyTorch) and bf16 (summed natively), mixtral in
  bf16 (float32 routing weights: summed by PyTorch);
- the CPU layer call (`moe.layer_cpu`: a step's MoE layer in one native call, up to 16 tokens) equals the
  router, the expert groups and the residual add of the tensor path to the bit, ties between experts
  included, and a decode through it gives the same logits as one without it;
- the packed state transfer (`transfer.packed_move`) gives back each tensor's dtype, shape and values, and a
  state moved that way finishes to the same residual stream; on CUDA through pinned memory both ways, and
  a state moved to the GPU and back gives the same residual stream.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from engine import kernels
from engine.config import ModelConfig
from engine.models import moe
from engine.models.transfer import MAX_PINNED_BYTES, packed_move
from tests.engine.cpu_decode import decode_logged

needs_kernel = pytest.mark.skipif(kernels._load() is None, reason=f"no native kernel: {kernels.status()}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2048, 2047, 16, 5])
def test_weighted_sum_matches_addcmul_steps(dtype, n):
    g = torch.Generator().manual_seed(n)
    for m, scale, zero in [(1, 1.0, True), (8, 1.0, True), (8, 30.0, False), (3, 1e-3, False), (9, 1.0, False)]:
        out0 = torch.zeros(1, n, dtype=dtype) if zero else (torch.randn(1, n, generator=g) * scale).to(dtype)
        y = (torch.randn(m, n, generator=g) * scale).to(dtype)
        wt = torch.rand(m, generator=g).to(dtype)
        want = out0.clone()
        for i in range(m):
            want.addcmul_(y[i:i + 1], wt[i:i + 1, None])
        got = out0.clone()
        assert kernels.weighted_sum(got, y, wt)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, scale, zero)
        if zero:                                   # a sum started from zero, whatever out held
            got = torch.full_like(out0, 7.0)
            assert kernels.weighted_sum(got, y, wt, from_zero=True)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (m, scale)


@needs_kernel
def test_weighted_sum_declines_float32():
    out = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not kernels.weighted_sum(out, torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(2))
    assert not kernels.weighted_sum(out.float(), torch.ones(2, 8), torch.ones(2))
    assert torch.equal(out, torch.zeros(1, 8, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_stacked_matches_linear_many(dtype):
    """Stacks as the weight store cuts them: each expert's block holds gate_up then down, so a stacked
    view steps over the other matrix (not contiguous as a whole)."""
    g = torch.Generator().manual_seed(1)
    e, n, k = 6, 40, 24
    blocks = [torch.randn(e, n * k + k * n, generator=g).to(dtype) for _ in range(2)]
    gu = [b[:, :n * k].view(e, n, k) for b in blocks]
    down = [b[:, n * k:].view(e, k, n) for b in blocks]
    assert not gu[0].is_contiguous()
    picks = [(0, 1), (0, 4), (1, 0), (1, 5)]
    h = torch.randn(1, k, generator=g).to(dtype)
    got = kernels.linear_stacked(h, gu, picks, min_weights=0)
    want = kernels.linear_many([h] * len(picks), [gu[s][j] for s, j in picks], min_weights=0)
    assert got is not None and torch.equal(got, want)
    act = torch.randn(len(picks), n, generator=g).to(dtype)
    got = kernels.linear_stacked(act, down, picks, min_weights=0)
    want = kernels.linear_many(list(act.split(1)), [down[s][j] for s, j in picks], min_weights=0)
    assert got is not None and torch.equal(got, want)
    assert kernels.linear_stacked(h, gu, [(0, e)], min_weights=0) is None           # no such expert
    assert kernels.linear_stacked(h, gu, picks) is None                              # below the size threshold


@needs_kernel
@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "float32"), ("qwen3_moe", "bfloat16"), ("mixtral", "bfloat16")])
def test_decode_path_matches_linear_many_path(tiny_model, arch, dtype, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)       # tiny matrices through the kernel
    monkeypatch.setattr(moe, "_BULK", False)            # (the prompt's steps: the linear_many path too)
    monkeypatch.setenv("SLIPSTREAM_MOE_CPU_LAYER", "0")  # (the layer call would take decode's whole layer)
    calls = []
    real = kernels.linear_stacked
    monkeypatch.setattr(kernels, "linear_stacked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    summed = []
    real_sum = kernels.weighted_sum
    monkeypatch.setattr(kernels, "weighted_sum", lambda *a, **kw: summed.append(real_sum(*a, **kw)) or summed[-1])
    path = tiny_model(arch)

    def run():
        return decode_logged(path, dtype)[:2]

    tokens, steps = run()
    assert calls
    assert any(summed) == (arch == "qwen3_moe" and dtype == "bfloat16")   # (mixtral: float32 routing weights)
    monkeypatch.setattr(moe, "_experts_decode", lambda parts, s: None)
    calls.clear()
    tokens_before, steps_before = run()
    assert not calls
    assert tokens == tokens_before
    assert len(steps) == len(steps_before) and all(torch.equal(a, b) for a, b in zip(steps, steps_before))


def test_packed_transfer_keeps_every_tensor():
    g = torch.Generator().manual_seed(2)
    parts = [torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.arange(7),
             torch.randn(3, generator=g), torch.randn(1, 3, generator=g).to(torch.float16),
             torch.randint(0, 9, (2, 3), generator=g)]
    moved = packed_move(parts, "cpu")
    for a, b in zip(parts, moved):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b)
        assert a.data_ptr() != b.data_ptr()


def test_packed_transfer_of_one_tensor_copies_it():
    x = torch.arange(6).view(2, 3)
    (y,) = packed_move([x], "cpu")
    assert torch.equal(x, y) and x.data_ptr() != y.data_ptr()


@pytest.mark.gpu
def test_packed_transfer_through_pinned_memory_both_ways():
    """Host -> GPU from a pinned staging buffer (no wait), GPU -> host into pinned memory after the wait:
    the same values, on the host side pinned; a part written on the GPU just before the move (queued
    work) arrives written; past MAX_PINNED_BYTES the move is pageable and still exact."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(64, 48, generator=g).to(torch.bfloat16), torch.arange(9), torch.randn(5, generator=g)]
    on_gpu = packed_move(parts, "cuda")
    assert all(t.is_cuda for t in on_gpu)
    on_gpu[0].mul_(2)                                   # queued on the stream before the move back
    waited = []
    back = packed_move(on_gpu, "cpu", lambda: (waited.append(1), torch.cuda.current_stream().synchronize()))
    assert waited == [1]
    assert torch.equal(back[0], parts[0] * 2) and torch.equal(back[1], parts[1]) and torch.equal(back[2], parts[2])
    assert all(t.is_pinned() for t in back)
    big = torch.randint(0, 255, (MAX_PINNED_BYTES + 64,), dtype=torch.uint8, generator=g)
    (big_gpu,) = packed_move([big], "cuda")
    (big_back,) = packed_move([big_gpu], "cpu")
    assert torch.equal(big_back, big) and not big_back.is_pinned()


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 5])
def test_state_moved_to_the_gpu_and_back_finishes_the_same(n):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg, w = _small_moe("qwen3_moe")
    first, second = ({k: v[a:b] if k.startswith("experts.") else v for k, v in w.items()} for a, b in ((0, 4), (4, 8)))
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    want = moe.finish(moe.experts_block(cfg, w, moe.router_block(cfg, w, x), range(8)))
    s = moe.experts_block(cfg, first, moe.router_block(cfg, w, x), range(4))     # (groups of 4 experts)
    assert torch.equal(moe.finish(moe.experts_block(cfg, second, s, range(4, 8))), want)
    s = moe.experts_block(cfg, first, moe.router_block(cfg, w, x), range(4))
    back = s.to("cuda").to("cpu")
    assert back.x.is_pinned()
    assert torch.equal(moe.finish(moe.experts_block(cfg, second, back, range(4, 8))), want)


def _small_moe(arch):
    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rope_theta=1e4, max_position_embeddings=64, dtype="bfloat16",
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=arch == "qwen3_moe")
    g = torch.Generator().manual_seed(3)
    w = {"ffn_norm.weight": torch.ones(32, dtype=torch.bfloat16),
         "router.weight": torch.randn(8, 32, generator=g).to(torch.bfloat16),
         "experts.gate_up.weight": (torch.randn(8, 32, 32, generator=g) * 0.1).to(torch.bfloat16),
         "experts.down.weight": (torch.randn(8, 32, 16, generator=g) * 0.1).to(torch.bfloat16)}
    return cfg, w


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_packed_state_finishes_the_same(arch):
    cfg, w = _small_moe(arch)
    g = torch.Generator().manual_seed(3)
    for n in (1, 5):
        x = torch.randn(n, 32, generator=g).to(torch.bfloat16)
        s = moe.router_block(cfg, w, x)
        half = moe.experts_block(cfg, w, moe.router_block(cfg, w, x), range(4))   # a partial sum moves too
        for state in (s, half):
            fields = [state.x, state.h, state.rows, state.weights] + ([] if state.out is None else [state.out])
            moved = packed_move(fields, "cpu")
            packed = moe.MoeState(moved[0], moved[1], moved[4] if state.out is not None else None, moved[2],
                                  moved[3], state.bounds)
            rest = range(8) if state is s else range(4, 8)
            a = moe.finish(moe.experts_block(cfg, w, state, rest))
            b = moe.finish(moe.experts_block(cfg, w, packed, rest))
            assert torch.equal(a, b)
    assert s.to("cpu") is s


@pytest.mark.parametrize("seed", range(5))
def test_one_token_routing_sorted_on_the_host_matches_the_general_path(seed):
    """Decode's routing state is sorted in Python (no tensor sort, count or cumsum): the same pairs,
    weights and expert bounds as the stable sort of the general path."""
    from engine.bench.shapes import get_shape

    cfg = get_shape("qwen3-30b-a3b")
    g = torch.Generator().manual_seed(seed)
    top_i = torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok][None]
    top_w = torch.rand(1, cfg.num_experts_per_tok, generator=g).to(torch.bfloat16)
    rows, weights, ends = moe._sorted_pairs(cfg, top_w, top_i)
    flat = top_i.reshape(-1)
    order = torch.argsort(flat, stable=True)
    want_ends = torch.cumsum(torch.bincount(flat, minlength=cfg.num_experts), 0).tolist()
    assert isinstance(ends, list) and ends == want_ends
    assert torch.equal(rows, order // cfg.num_experts_per_tok)
    assert torch.equal(weights, top_w.reshape(-1)[order])
    two = moe._sorted_pairs(cfg, top_w.repeat(2, 1), top_i.repeat(2, 1))   # more tokens: the general path
    assert not isinstance(two[2], list) and two[2][-1].item() == 2 * cfg.num_experts_per_tok


def _layer_cases(test):
    """A layer-level MoE test over both devices, both MoE architectures, float32 and bf16, and fused or
    separate gate/up stacks."""
    for name, values in (("fused_gate_up", [True, False]), ("dtype", [torch.float32, torch.bfloat16]),
                         ("arch", ["qwen3_moe", "mixtral"]),
                         ("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
                             not torch.cuda.is_available(), reason="needs CUDA"))])):
        test = pytest.mark.parametrize(name, values)(test)
    return test


def _one_expert_at_a_time(groups, want) -> None:
    """The routed experts of `groups` added into state `want` one at a time through PyTorch."""
    for w, experts in groups:
        for j, e in enumerate(experts):
            a, b = want.bounds[e], want.bounds[e + 1]
            if b > a:
                moe._add_expert(want, a, b, moe._expert(w, j, want.h[want.rows[a:b]]), False)


def _moe_layer(arch: str, dtype: torch.dtype, fused_gate_up: bool, seed: int, device: str):
    cfg = ModelConfig(arch=arch, vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rope_theta=1e4, max_position_embeddings=64,
                      dtype=str(dtype).split(".")[1], num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=16, norm_topk_prob=arch == "qwen3_moe", expert_group_size=3)
    g = torch.Generator().manual_seed(seed)
    router = {"ffn_norm.weight": (1 + 0.1 * torch.randn(32, generator=g)).to(dtype).to(device),
              "router.weight": torch.randn(8, 32, generator=g).to(dtype).to(device)}
    gate_up = torch.randn(8, 32, 32, generator=g) * 0.2
    down = torch.randn(8, 32, 16, generator=g) * 0.2
    groups = []
    for experts in cfg.expert_groups():
        # each expert's gate, up and down back to back in one buffer, the stacks views of it (as the
        # weight store lays a group out): no stack is one contiguous tensor
        sl, n = slice(experts.start, experts.stop), len(experts)
        buf = torch.cat([gate_up[sl].reshape(n, -1), down[sl].reshape(n, -1)], dim=1).to(dtype).to(device)
        w = {"experts.down.weight": buf[:, 1024:].view(n, 32, 16)}
        if fused_gate_up:
            w["experts.gate_up.weight"] = buf[:, :1024].view(n, 32, 32)
        else:
            w["experts.gate.weight"] = buf[:, :512].view(n, 16, 32)
            w["experts.up.weight"] = buf[:, 512:1024].view(n, 16, 32)
        assert not any(t.is_contiguous() for t in w.values()) or n == 1
        groups.append((w, experts))
    return cfg, router, groups, g


@_layer_cases
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_a_few_tokens_layer_in_one_call_matches_the_general_path(device, arch, dtype, fused_gate_up, tokens):
    """A MoE layer held in one place runs for a step of a few tokens with nothing read back to the host
    (every group's experts over the tokens, each token's routed rows kept, summed in ascending expert
    order): the same output as the router, the groups one by one and the residual add, to rounding, over
    tokens routed to one group or spread over several."""
    for seed in range(6):
        cfg, router, groups, g = _moe_layer(arch, dtype, fused_gate_up, seed, device)
        x = torch.randn(tokens, 32, generator=g).to(dtype).to(device)
        s = moe.router_block(cfg, router, x)
        for w, experts in groups:
            s = moe.experts_block(cfg, w, s, experts)
        want = moe.finish(s)
        got = moe.layer_few_tokens(cfg, router, groups, x)
        assert got.dtype == want.dtype and got.shape == want.shape
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (seed, (got - want).abs().max())
        assert not torch.equal(got, x)


@_layer_cases
@pytest.mark.parametrize("tokens", [17, 40, 300])
def test_padded_runs_of_experts_match_one_expert_at_a_time(device, arch, dtype, fused_gate_up, tokens):
    """A step of many tokens runs a GPU group's experts in padded runs through batched matmuls over the
    stacked weights (`moe.experts_padded`): the same output as one expert at a time, to rounding; no run
    gathers more rows than the step has tokens."""
    for seed in range(3):
        cfg, router, groups, g = _moe_layer(arch, dtype, fused_gate_up, seed, device)
        x = torch.randn(tokens, 32, generator=g).to(dtype).to(device)
        want, got = moe.router_block(cfg, router, x), moe.router_block(cfg, router, x)
        gathered = []
        real = torch.Tensor.index_select

        def spy(t, dim, index, real=real, gathered=gathered):
            gathered.append(index.numel())
            return real(t, dim, index)

        for w, experts in groups:
            for j, e in enumerate(experts):        # the reference: PyTorch, one expert at a time
                a, b = want.bounds[e], want.bounds[e + 1]
                if b > a:
                    moe._add_expert(want, a, b, moe._expert(w, j, want.h[want.rows[a:b]]), False)
            torch.Tensor.index_select = spy
            try:
                got = moe.experts_padded(cfg, w, got, experts)
            finally:
                torch.Tensor.index_select = real
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        assert torch.allclose(moe.finish(got).float(), moe.finish(want).float(), rtol=tol, atol=tol), seed
        assert gathered and max(gathered) <= tokens


@needs_kernel
def test_a_batch_routing_more_than_four_rows_to_an_expert_keeps_the_native_job(monkeypatch):
    """On an AMX CPU a single bf16 matrix of more than 4 rows is PyTorch's, but a batch's routed experts
    stay in one native job up to 16 rows each (`kernels.max_rows_many`): PyTorch would take them one op at
    a time. Same output as one expert at a time, to rounding."""
    monkeypatch.delenv("SLIPSTREAM_NATIVE_MAX_ROWS", raising=False)
    monkeypatch.setattr(kernels, "_amx", True)
    monkeypatch.setattr(kernels, "_max_rows", {})
    jobs = []
    real = kernels.linear_many
    monkeypatch.setattr(kernels, "linear_many", lambda xs, ws, *a: jobs.append(max(x.shape[0] for x in xs))
                        or real(xs, ws, *a))
    cfg, router, groups, g = _moe_layer("qwen3_moe", torch.bfloat16, True, 0, "cpu")
    x = torch.randn(16, 32, generator=g).to(torch.bfloat16)
    got, want = moe.router_block(cfg, router, x), moe.router_block(cfg, router, x)
    assert max(b - a for a, b in itertools.pairwise(got.bounds)) > kernels.max_rows(torch.bfloat16)
    got = moe.experts_blocks(cfg, groups, got)
    _one_expert_at_a_time(groups, want)
    assert jobs and max(jobs) > 4
    assert torch.allclose(moe.finish(got).float(), moe.finish(want).float(), rtol=3e-2, atol=3e-2)


@needs_kernel
@pytest.mark.parametrize("fused_gate_up", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tokens", [2, 5, 16])
def test_batch_step_in_bulk_matches_expert_by_expert(arch, dtype, fused_gate_up, tokens, monkeypatch):
    """A batch's step on the CPU (`moe._experts_batch`: one gather, one native job per projection over the
    routed experts with their row counts, one `index_add_`) gives the bits of the per-expert `linear_many`
    path, over all groups of a layer or a consecutive part of them; groups that are not consecutive take
    the per-expert path."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)
    bulk = []
    real = moe._experts_batch
    monkeypatch.setattr(moe, "_experts_batch", lambda parts, s: bulk.append(real(parts, s)) or bulk[-1])
    for seed in range(4):
        cfg, router, groups, g = _moe_layer(arch, dtype, fused_gate_up, seed, "cpu")
        x = torch.randn(tokens, 32, generator=g).to(dtype)
        for parts in (groups, groups[1:], [groups[0], groups[2]]):
            results = []
            for on in (True, False):
                monkeypatch.setattr(moe, "_BULK", on)
                bulk.clear()
                s = moe.router_block(cfg, router, x)
                s = moe.experts_blocks(cfg, parts, s)
                results.append(s.out)
                consecutive = all(a[1].stop == b[1].start for a, b in itertools.pairwise(parts))
                assert bulk == ([True] if on and consecutive else [None] if on else []), (on, bulk)
            assert results[0] is not None and torch.equal(results[0], results[1]), (seed, len(parts))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [2048, 37])
def test_scatter_add_matches_index_add_one_index_at_a_time(dtype, n):
    g = torch.Generator().manual_seed(n)
    out0 = (torch.randn(5, n, generator=g) * 4).to(dtype)
    rows = torch.tensor([3, 0, 3, 3, 1, 0, 4, 3])
    y = torch.randn(len(rows), n, generator=g).to(dtype)
    want = out0.clone()
    for i in range(len(rows)):
        want.index_add_(0, rows[i:i + 1], y[i:i + 1])
    got = out0.clone()
    assert kernels.scatter_add(got, rows, y)
    assert torch.equal(got, want)
    assert not kernels.scatter_add(got, torch.tensor([0, 5, 1, 1, 1, 1, 1, 1]), y)          # a row out of range
    assert not kernels.scatter_add(got, rows, y.float() if dtype != torch.float32 else y.half())
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_sized_scatter_add_split_across_threads_keeps_the_order(dtype):
    """A prompt's scatter (hundreds of pairs, thousands of columns) is cut by columns across the pool;
    each element still takes its adds in order: the bits of `index_add_` one index at a time."""
    g = torch.Generator().manual_seed(7)
    m, n = 640, 2080
    rows = torch.randint(0, 90, (m,), generator=g)
    y = torch.randn(m, n, generator=g).to(dtype)
    out0 = torch.randn(90, n, generator=g).to(dtype)
    want = out0.clone()
    for i in range(m):
        want.index_add_(0, rows[i:i + 1], y[i:i + 1])
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, 2, threads}):
            torch.set_num_threads(t)
            got = out0.clone()
            assert kernels.scatter_add(got, rows, y)
            assert torch.equal(got, want), t
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_batch_step_without_the_scatter_kernel_adds_expert_by_expert(monkeypatch):
    """Where `kernels.scatter_add` declines, the bulk path adds one `index_add_` per expert: the same
    bits."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    cfg, router, groups, g = _moe_layer("qwen3_moe", torch.bfloat16, True, 0, "cpu")
    x = torch.randn(9, 32, generator=g).to(torch.bfloat16)
    want = moe.experts_blocks(cfg, groups, moe.router_block(cfg, router, x)).out
    monkeypatch.setattr(kernels, "scatter_add", lambda *a: False)
    got = moe.experts_blocks(cfg, groups, moe.router_block(cfg, router, x)).out
    assert torch.equal(got, want)


@needs_kernel
@pytest.mark.skipif(not kernels.tiles(), reason=f"no AMX tiles here: {kernels.status()}")
@pytest.mark.parametrize("fused_gate_up", [True, False])
def test_a_prompt_step_routing_many_rows_to_an_expert_runs_in_bulk_on_the_tiles(fused_gate_up, monkeypatch):
    """A prompt's step on the CPU routes more than 16 rows to an expert: on AMX tiles it still runs in
    bulk (`_experts_batch`), in pieces of at most `BULK_ROWS` pairs where the step has more (the same bits
    as one piece), and within rounding of PyTorch expert by expert."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    bulk = []
    real = moe._experts_batch
    monkeypatch.setattr(moe, "_experts_batch", lambda parts, s: bulk.append(real(parts, s)) or bulk[-1])
    cfg, router, groups, g = _moe_layer("qwen3_moe", torch.bfloat16, fused_gate_up, 1, "cpu")
    x = torch.randn(96, 32, generator=g).to(torch.bfloat16)
    s = moe.router_block(cfg, router, x)
    assert max(b - a for a, b in itertools.pairwise(s.bounds)) > kernels.MAX_ROWS
    got = moe.experts_blocks(cfg, groups, s).out.clone()
    assert bulk == [True]
    monkeypatch.setattr(moe, "BULK_ROWS", 40)
    pieces = moe.experts_blocks(cfg, groups, moe.router_block(cfg, router, x)).out
    assert torch.equal(pieces, got)
    want = moe.router_block(cfg, router, x)
    _one_expert_at_a_time(groups, want)
    assert torch.allclose(got.float(), want.out.float(), rtol=2e-2, atol=2e-2)


def _tie_layer(dtype, fused_gate_up: bool, seed: int, norm_topk: bool, router_f32: bool = False):
    """`_moe_layer` with experts 2 and 5 scoring the same (equal router rows), so the top-k ties; `router_f32`:
    the router and the norm in float32."""
    cfg, router, groups, g = _moe_layer("qwen3_moe", dtype, fused_gate_up, seed, "cpu")
    cfg = dataclasses.replace(cfg, norm_topk_prob=norm_topk)
    r = router["router.weight"].clone()
    r[5] = r[2]
    router["router.weight"] = r.float() if router_f32 else r
    if router_f32:                       # (as a GGUF file keeps them: router and norms in F32)
        router["ffn_norm.weight"] = router["ffn_norm.weight"].float()
    return cfg, router, groups, g


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused_gate_up", [True, False])
@pytest.mark.parametrize("norm_topk,router_f32", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_cpu_layer_call_matches_the_tensor_path_to_the_bit(dtype, fused_gate_up, norm_topk, router_f32, tokens,
                                                           monkeypatch):
    """A step of 1, 3 or 16 tokens through `layer_cpu` (norm, router, top k, the routed experts, their
    weighted sum and the residual add in one native call) gives the bits of `router_block`,
    `experts_blocks` and `finish` (one token: the ordered multiply-adds; more: each pair's weighted output
    rounded, then added in expert order) with the same native matmuls (thresholds at zero, so the tensor
    path takes them too), over tokens whose top k includes tied experts."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)
    ties = 0
    for seed in range(12):
        cfg, router, groups, g = _tie_layer(dtype, fused_gate_up, seed, norm_topk, router_f32)
        for _ in range(8 if tokens == 1 else 3):
            x = torch.randn(tokens, 32, generator=g).to(dtype)
            s = moe.router_block(cfg, router, x)
            for row in range(tokens):
                picked = [int(e) for e in s.rows.new_tensor(range(cfg.num_experts))
                          if any(int(r) == row for r in s.rows[s.bounds[e]:s.bounds[e + 1]])]
                ties += 2 in picked and 5 not in picked
            want = moe.finish(moe.experts_blocks(cfg, groups, s))
            got = moe.layer_cpu(cfg, router, groups, x)
            assert got is not None and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (seed, (got - want).abs().max())
    assert ties        # (some tokens had the tied pair at the k-th place: the lower expert was picked)


@needs_kernel
def test_cpu_layer_call_declines_what_it_does_not_cover():
    cfg, router, groups, g = _moe_layer("qwen3_moe", torch.bfloat16, True, 0, "cpu")
    x = torch.randn(1, 32, generator=g).to(torch.bfloat16)
    assert moe.layer_cpu(cfg, router, groups, x) is not None
    assert moe.layer_cpu(cfg, router, groups, x.repeat(16, 1)) is not None
    assert moe.layer_cpu(cfg, router, groups, x.repeat(17, 1)) is None                 # more than 16 tokens
    assert moe.layer_cpu(cfg, router, groups[1:], x) is None                           # experts missing
    assert moe.layer_cpu(cfg, router, groups[::-1], x) is None                         # out of order
    mix = _moe_layer("mixtral", torch.bfloat16, True, 0, "cpu")
    assert moe.layer_cpu(mix[0], mix[1], mix[2], x) is None                            # float32 routing weights
    f32 = _moe_layer("qwen3_moe", torch.float32, True, 0, "cpu")
    assert moe.layer_cpu(f32[0], f32[1], f32[2], x.float()) is None                    # float32 activations


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_through_the_cpu_layer_call_gives_the_same_logits(tiny_model, dtype, monkeypatch):
    """A generation whose MoE layers run as one native call each gives the logits of the general path
    (router, groups and residual add one by one) at every step, to the bit: the short prompt's step and each
    decode step, one call per layer each."""
    monkeypatch.setattr(kernels, "MIN_WEIGHTS", 0)
    monkeypatch.setattr(kernels, "MIN_WEIGHTS_16BIT", 0)
    calls = []
    real = kernels.moe_layer
    monkeypatch.setattr(kernels, "moe_layer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    path = tiny_model("qwen3_moe")

    def run(layer_call: str):
        monkeypatch.setenv("SLIPSTREAM_MOE_CPU_LAYER", layer_call)
        return decode_logged(path, dtype)[:3]

    tokens, steps, layers = run("1")
    assert len(calls) == layers * len(tokens)      # every step's layers: the short prompt's and each decode step's
    calls.clear()
    tokens_before, steps_before, _ = run("0")
    assert not calls
    assert tokens == tokens_before
    assert len(steps) == len(steps_before) and all(torch.equal(a, b) for a, b in zip(steps, steps_before))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_native_routing_picks_what_softmax_and_a_stable_sort_pick(dtype, norm_topk):
    """`kernels.moe_route` (a step of up to 16 tokens on the CPU, shared with the layer call) against
    PyTorch's softmax and a stable descending sort: the same experts in the same order, ties to the lower
    expert, and 16-bit weights within one rounding (float32: a few units in the last place; the exp and the
    sum's order are the C library's)."""
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, rope_theta=1e4, max_position_embeddings=64,
                      dtype="bfloat16", num_experts=128, num_experts_per_tok=8, moe_intermediate_size=16,
                      norm_topk_prob=norm_topk)
    g = torch.Generator().manual_seed(3)
    ties = 0
    for rows in [1] * 150 + [16] * 10:
        logits = (torch.randn(rows, 128, generator=g) * 2).to(dtype)
        logits[:, 77] = logits[:, 20]                       # a tie, sometimes at the k-th place
        got_w, got_i = kernels.moe_route(logits, 8, norm_topk, dtype)
        probs = torch.softmax(logits.float(), dim=-1)
        want_w, want_i = torch.sort(probs, dim=-1, descending=True, stable=True)
        want_w, want_i = want_w[:, :8], want_i[:, :8]
        if norm_topk:
            want_w = want_w / want_w.sum(dim=-1, keepdim=True)
        assert torch.equal(got_i, want_i)
        ties += sum(20 in r and 77 not in r for r in got_i.tolist())
        assert got_w.dtype == dtype
        # (float32 keeps the sums' last bits: over 128 experts their order moves a few of them)
        rtol = torch.finfo(dtype).eps * (8 if dtype == torch.float32 else 1)
        assert torch.allclose(got_w.float(), want_w.to(dtype).float(), rtol=rtol, atol=0)
    assert ties
    assert kernels.moe_route(torch.zeros(17, 128), 8, True, torch.float32) is None      # up to 16 tokens
    assert moe.route(cfg, logits, dtype)[1].equal(got_i)                               # moe.route takes it


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_silu_times_up_matches_pytorch_for_every_16bit_gate(dtype):
    """The layer call's silu(gate) * up (`kernels.silu_mul`) against PyTorch's F.silu(gate) * up over every
    finite 16-bit gate value, through its vector and its scalar path: with up = 1 (silu's rounding alone) and
    with random up (the product's)."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    gate = gate[torch.isfinite(gate.float())].contiguous()
    g = torch.Generator().manual_seed(5)
    for up in (torch.ones_like(gate), (torch.randn(gate.shape, generator=g) * 3).to(dtype)):
        got = kernels.silu_mul(gate, up)                       # (16 values at a time: the vector path)
        tail = torch.cat([kernels.silu_mul(gate[i:i + 15], up[i:i + 15]) for i in range(0, gate.numel(), 15)])
        assert torch.equal(tail.view(torch.int16), got.view(torch.int16))   # (fewer than 16: the scalar path)
        want = torch.nn.functional.silu(gate) * up
        same = got.view(torch.int16) == want.view(torch.int16)
        both_nan = torch.isnan(got.float()) & torch.isnan(want.float())
        assert bool((same | both_nan).all()), gate[~(same | both_nan)][:8]
