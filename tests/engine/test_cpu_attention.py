"""Native paged decode attention (engine.kernels.paged_decode_attention): against PyTorch's SDPA over the
gathered context, through block tables in any order, and in the engine (decode steps with it on and off,
its fallbacks: FP8 pools, prefill, the kernel off)."""

from __future__ import annotations

import os
import platform
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import engine
from engine import kernels
from engine.sharding.executor import Executor, StepItem
from engine.sharding.kvcache import BLOCK_SIZE, Sequence
from engine.sharding.plan import Placement, Plan, PlanSet
from engine.sharding.spec import ModelSpec

needs_kernel = pytest.mark.skipif(kernels._load() is None, reason=f"no native kernel: {kernels.status()}")


def _pool(n_blocks, kv_heads, d, dtype, g):
    return [torch.randn(n_blocks, BLOCK_SIZE, kv_heads, d, generator=g).to(dtype) for _ in range(2)]


def _table(kind: str, nb: int, n_blocks: int, g) -> torch.Tensor:
    if kind == "consecutive":
        return torch.arange(3, 3 + nb)
    if kind == "reversed":
        return torch.arange(n_blocks - 1, n_blocks - 1 - nb, -1)
    return torch.randperm(n_blocks, generator=g)[:nb]


def _reference(q, k, v, table, length):
    """float32 SDPA over the context gathered from the pool: [heads, head_dim]."""
    kv_heads, d = k.shape[2:]
    keys, values = (p[table].reshape(-1, kv_heads, d)[:length].transpose(0, 1).float() for p in (k, v))
    return F.scaled_dot_product_attention(q.float()[None, :, None], keys[None], values[None],
                                          enable_gqa=q.shape[0] != kv_heads)[0, :, 0]


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at |x| (float32 tensor)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(tiny))) - mant)


def _assert_rounded_once(out, ref, dtype, noise: float = 1e-6):
    """Within one ulp of the float32 reference: the float32 result rounded once. Float32 sums in another
    order differ by about 1e-7 of the values summed (`noise`: more where large scores amplify it), far
    less than an ulp of a 16-bit type except near zero, where it is the bound."""
    assert out.dtype == dtype
    err = (out.float() - ref).abs()
    assert bool((err <= _ulp(ref, dtype) + noise).all()), err.max().item()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 64), (4, 4, 128), (6, 2, 80)])
@pytest.mark.parametrize("kind", ["consecutive", "scattered", "reversed"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 257, 300, 2000])
def test_matches_sdpa_over_the_gathered_context(dtype, heads, kv_heads, d, kind, length):
    g = torch.Generator().manual_seed(length * 31 + heads)
    nb = -(-length // BLOCK_SIZE)
    n_blocks = nb + 5
    k, v = _pool(n_blocks, kv_heads, d, dtype, g)
    table = _table(kind, nb, n_blocks, g)
    q = torch.randn(heads, d, generator=g).to(dtype)
    out = kernels.paged_decode_attention(q, k, v, [table], [length])
    assert out is not None and out.shape == q.shape
    ref = _reference(q, k, v, table, length)
    _assert_rounded_once(out, ref, dtype)
    # The check can fail: one block read from the wrong place, or (with a partial last block, else the
    # same keys in another order are the same context) the first and last blocks swapped.
    spare = next(b for b in range(n_blocks) if b not in table.tolist())
    wrong = [torch.cat([table[:-1], torch.tensor([spare])])]
    if length % BLOCK_SIZE and nb > 1:
        wrong.append(torch.cat([table[-1:], table[1:-1], table[:1]]))
    for bad in wrong:
        other = kernels.paged_decode_attention(q, k, v, [bad], [length])
        assert (other.float() - ref).abs().max() > 4 * _ulp(ref.abs().max(), dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_scores_and_tiny_ones(dtype):
    """Softmax with the max subtracted: scores of hundreds (exp overflows without it) and one key that
    dominates all others."""
    g = torch.Generator().manual_seed(3)
    k, v = _pool(20, 2, 64, dtype, g)
    k.mul_(8)
    q = (torch.randn(4, 64, generator=g) * 8).to(dtype)
    table = torch.randperm(20, generator=g)[:19]
    for length in (5, 300):
        out = kernels.paged_decode_attention(q, k, v, [table], [length])
        ref = _reference(q, k, v, table, length)
        assert torch.isfinite(out).all()
        _assert_rounded_once(out, ref, dtype, noise=1e-4)     # scores of ~64: their float32 error, e^that


@needs_kernel
def test_several_sequences_in_one_call_equal_each_alone():
    """A batch (rows of a [heads, N, head_dim] query, lengths from one block to several chunks) gives
    each sequence bit for bit what it gets alone, and leaves the other rows alone."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 8, 2, 64
    k, v = _pool(300, kv_heads, d, torch.bfloat16, g)
    lengths = [1, 40, 700, 17, 2000]
    order = torch.randperm(300, generator=g).tolist()
    tables, at = [], 0
    for length in lengths:
        nb = -(-length // BLOCK_SIZE)
        tables.append(torch.tensor(order[at:at + nb]))
        at += nb
    q = torch.randn(heads, 7, d, generator=g).to(torch.bfloat16)
    rows = [6, 0, 3, 2, 5]
    out = torch.full_like(q, 7.0)
    assert kernels.paged_decode_attention(q, k, v, tables, lengths, rows, out) is out
    for table, length, r in zip(tables, lengths, rows):
        alone = kernels.paged_decode_attention(q[:, r].contiguous(), k, v, [table], [length])
        assert torch.equal(out[:, r], alone)
    assert (out[:, [1, 4]] == 7.0).all()


@needs_kernel
def test_thread_count_does_not_change_results():
    """Work is cut by context chunks of a fixed size, merged in chunk order: one thread and several give
    the same bits (a long context, big enough to wake the pool)."""
    g = torch.Generator().manual_seed(9)
    k, v = _pool(200, 4, 128, torch.bfloat16, g)
    table = torch.randperm(200, generator=g)[:190]
    q = torch.randn(16, 128, generator=g).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.paged_decode_attention(q, k, v, [table], [3000])
        torch.set_num_threads(3)
        several = [kernels.paged_decode_attention(q, k, v, [table], [3000]) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(one, s) for s in several)


def test_kernel_reads_the_cache_block_size():
    assert kernels.KV_BLOCK == BLOCK_SIZE


@needs_kernel
def test_declines_what_it_cannot_run():
    g = torch.Generator().manual_seed(1)
    k, v = _pool(4, 2, 64, torch.bfloat16, g)
    q = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    t = torch.arange(4)
    assert kernels.paged_decode_attention(q, k, v, [t], [64]) is not None
    assert kernels.paged_decode_attention(q.float(), k, v, [t], [64]) is None               # mixed dtypes
    assert kernels.paged_decode_attention(q.double(), k.double(), v.double(), [t], [64]) is None
    k8 = k.view(torch.uint8)                                                               # an FP8 pool's bytes
    assert kernels.paged_decode_attention(q, k8, k8, [t], [64]) is None
    assert kernels.paged_decode_attention(q, k, v, [t], [65]) is None                      # past the table
    assert kernels.paged_decode_attention(q, k, v, [torch.tensor([0, 1, 2, 4])], [64]) is None   # past the pool
    assert kernels.paged_decode_attention(q[:3], k, v, [t], [64]) is None                  # 3 heads over 2
    assert kernels.paged_decode_attention(q, k, v, [t.int()], [64]) is None
    assert kernels.paged_decode_attention(q.to("meta"), k, v, [t], [64]) is None          # off the CPU
    big = torch.randn(1, BLOCK_SIZE, 1, 512).bfloat16()
    assert kernels.paged_decode_attention(torch.randn(1, 512).bfloat16(), big, big, [t[:1]], [3]) is None
    for switch in (kernels.set_enabled, kernels.set_attention_enabled):
        old = switch(False)
        try:
            assert kernels.paged_decode_attention(q, k, v, [t], [64]) is None
        finally:
            switch(old)


# ---- in the engine ---------------------------------------------------------------------------------

def _executor(path, dtype: torch.dtype, fp8: bool = False) -> Executor:
    from engine.loading import load_model

    loaded = load_model(path)
    cfg = replace(loaded.config, dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    ex = Executor(cfg, {n: w.to(dtype) for n, w in loaded.weights.items()}, None, dtype, kv_fp8=fp8)
    cpu = {s.name: Placement.CPU for s in ModelSpec.from_config(cfg).sublayers}
    ex.activate(Plan(1, "manual", cpu, 0))
    return ex


def _decode(ex: Executor, prompts: list[list[int]], steps: int, batched: bool):
    """Greedy decode of each prompt (prefilled one by one), stepping the sequences together in one batch
    or one after the other (their blocks interleave in the pool either way): tokens and every step's
    logits per sequence."""
    seqs = [Sequence() for _ in prompts]
    last = [ex.forward(s, p) for s, p in zip(seqs, prompts)]
    toks: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(steps):
        nxt = [int(x[-1].argmax()) for x in last]
        if batched:
            last = ex.forward_batch([StepItem(s, [t]) for s, t in zip(seqs, nxt)])
        else:
            last = [ex.forward(s, [t]) for s, t in zip(seqs, nxt)]
        for i, t in enumerate(nxt):
            toks[i].append(t)
            logits[i].append(last[i][-1])
    tables = [list(s.block_table) for s in seqs]
    for s in seqs:
        ex.kv.release(s)
    return toks, logits, tables


class _Spy:
    """Counts the native kernel's answers (calls that did not fall back)."""

    def __init__(self, monkeypatch):
        self.native = self.declined = 0
        real = kernels.paged_decode_attention

        def spy(*args, **kwargs):
            out = real(*args, **kwargs)
            if out is None:
                self.declined += 1
            else:
                self.native += 1
            return out

        monkeypatch.setattr(kernels, "paged_decode_attention", spy)


PROMPTS = [list(range(5, 40)), list(range(100, 117)), [7, 3, 9]]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batched", [False, True])
def test_decode_with_native_attention_matches_pytorch(tiny_model, monkeypatch, dtype, batched):
    ex = _executor(tiny_model("llama3"), dtype)
    spy = _Spy(monkeypatch)
    old = kernels.set_attention_enabled(False)
    try:
        want_toks, want_logits, _ = _decode(ex, PROMPTS, 20, batched)
    finally:
        kernels.set_attention_enabled(old)
    assert spy.native == 0
    toks, logits, tables = _decode(ex, PROMPTS, 20, batched)
    layers = ex.cfg.num_layers
    assert spy.native == 20 * layers * (1 if batched else len(PROMPTS)) and spy.declined == 0
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables)     # block tables out of order
    assert toks == want_toks
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    for got, want in zip(logits, want_logits):
        for a, b in zip(got, want):
            assert ((a - b).abs().max() / b.abs().max()).item() < tol


@needs_kernel
def test_prefill_and_fp8_pools_keep_pytorch_attention(tiny_model, monkeypatch):
    """A step of several tokens never asks the kernel; an FP8 pool is declined before it is asked
    (attend_decode answers None) and decodes as before."""
    spy = _Spy(monkeypatch)
    ex = _executor(tiny_model("llama3"), torch.float32)
    seq = Sequence()
    ex.forward(seq, list(range(5, 60)))
    assert spy.native == spy.declined == 0
    fp8 = _executor(tiny_model("llama3"), torch.float32, fp8=True)
    assert fp8.kv.attend_decode(0, [(Sequence(block_table=[0], length=1), 1)], torch.zeros(4, 1, 16)) is None
    toks, _, _ = _decode(fp8, PROMPTS[:2], 8, batched=True)
    old = kernels.set_attention_enabled(False)
    try:
        want, _, _ = _decode(fp8, PROMPTS[:2], 8, batched=True)
    finally:
        kernels.set_attention_enabled(old)
    assert toks == want and spy.native == 0


@needs_kernel
def test_sim_plans_decode_the_same_bits(tiny_model):
    """On the simulated accelerator every tensor is on the CPU, so every plan (attention on the CPU, on
    the "GPU" with its KV there, or streamed over a host-resident KV cache) takes the native kernel for
    a decode token: the same logits to the bit, single and batched steps."""
    eng = engine.open_model(tiny_model("llama3"), device="sim", backend="torch", vram_budget="1GiB")
    names = [s.name for s in eng.spec.sublayers]
    plans = {
        "cpu": ({n: Placement.CPU for n in names}, None),
        "resident": ({n: Placement.RESIDENT for n in names}, None),
        "host kv": ({n: (Placement.STREAMED if n.endswith(".attn") else Placement.CPU) for n in names}, 0),
    }
    rng = random.Random(3)
    mixed = {n: rng.choice(list(Placement)) for n in names}
    plans["mixed"] = (mixed, 1)
    got = {}
    for label, (placement, kv_layers) in plans.items():
        ps = PlanSet(eng.budget, [Plan(t, "manual", dict(placement), 2, kv_layers=kv_layers) for t in eng.tiers])
        eng._make_planset = lambda budget, kv_tokens=None, ps=ps: ps
        eng.set_vram_budget(eng.budget)
        got[label] = [_decode(eng.executor, PROMPTS, 6, batched) for batched in (False, True)]
    eng.close()
    ref = got.pop("cpu")
    for label, runs in got.items():
        for (toks, logits, _), (want_toks, want_logits, _) in zip(runs, ref):
            assert toks == want_toks, label
            assert all(torch.equal(a, b) for la, lb in zip(logits, want_logits) for a, b in zip(la, lb)), label


_GENERIC_CHECK = """
import torch
import torch.nn.functional as F
from engine import kernels
from engine.models import dense
from tests.engine import test_cpu_attention as t, test_cpu_kernel as m
print(kernels.status(), kernels.attention_ready())
w, x = torch.randn(64, 32), torch.randn(1, 32)
print("matmul", kernels.linear(x, w, min_weights=0) is not None)
assert torch.allclose(dense.linear(x, w), F.linear(x, w), atol=1e-5)      # (answered either way)
if kernels.linear(x, w, min_weights=0) is not None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows in (1, 2, 4, 5, 16):
            for shape in ((300, 1024), (37, 50), (5, 33), (1, 1)):
                m.test_matches_float64_reference(dtype, rows, shape)
        m.test_linear_many_matches_each_matmul(dtype)
    m.test_several_threads_split_rows_exactly()
    m.test_prefetch_distances_change_no_bits(4100)
    print("matmul checked")
if kernels.attention_ready():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for heads, kv_heads, d in ((8, 2, 64), (6, 2, 80)):
            for length in (1, 17, 300, 2000):
                t.test_matches_sdpa_over_the_gathered_context(dtype, heads, kv_heads, d, "scattered", length)
        t.test_large_scores_and_tiny_ones(dtype)
    t.test_several_sequences_in_one_call_equal_each_alone()
    t.test_thread_count_does_not_change_results()
    print("checked")
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("cc") is None,
                    reason="x86 builds with a C compiler only")
@pytest.mark.parametrize("arch,fast", [("haswell", True), ("x86-64", False)])
def test_builds_without_avx512(tmp_path, arch, fast):
    """The library built for a CPU without AVX-512: with AVX2, FMA and F16C (most gaming CPUs) its matmuls
    take their AVX2 path and match a float64 reference as the AVX-512 ones do (every dtype, 1-16 rows, rows
    that end mid-vector, one thread or two, any prefetch distance), and its plain-C attention, vectorized by
    the compiler, matches SDPA; an SSE2-only build (element by element, slower than PyTorch) declines both,
    and they stay with PyTorch."""
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\nargs=""\nfor a in "$@"; do [ "$a" = "-march=native" ] && a="-march={arch}"; '
                  f'args="$args $a"; done\nexec {shutil.which("cc")} $args\n')
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "SLIPSTREAM_KERNEL_CACHE": str(tmp_path / "cache"),
           "SLIPSTREAM_NATIVE_MAX_ROWS": "16"}     # (every row count native, also on a CPU with AMX)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _GENERIC_CHECK], check=False, capture_output=True, text=True,
                       env={**env, "PYTHONPATH": str(root)}, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    status, ready = lines[0].rsplit(" ", 1)
    assert status.startswith("native AVX2" if fast else "native portable C") and ready == str(fast)
    assert lines[1] == f"matmul {fast}"
    assert ("matmul checked" in lines) == fast and ("checked" in lines) == fast
