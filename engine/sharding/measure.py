"""The install-stage benchmarks: measure this machine the way the engine runs, into a profile dict.

CPU: `F.linear` throughput by dtype, shape class (attention projection, FFN, output head) and token
count, at the engine's thread count (`torch.get_num_threads()`); bf16 GEMV rate by thread count; attention
(scaled-dot-product over a KV cache) rates; per-op overhead. GPU (CUDA only): the same tables timed with
CUDA events; pinned host-to-device and device-to-host bandwidth on a side copy stream; the cost of moving
a small activation between CPU and GPU; and the two rates that matter for overlap: copy bandwidth while
the CPU computes and CPU throughput while copies run. Nothing spins: waits poll a CUDA event with a short
sleep, as the executor does. Decode-shaped GEMVs cycle through more weight bytes than any cache holds,
and beside a GPU the CPU's weights sit in pinned memory, where the executor keeps them. The engine's own
CPU FFN and attention blocks are timed against what the tables predict for them (the profile's
`block_factor` and `attn_block_factor`).

`python -m engine.sharding.measure --attn-block --update PATH` adds the attention block's factor to a
stored profile database file in place (seconds), without measuring the rest again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.models import dense

Progress = Callable[[float, str], None]
DTYPES = ("bfloat16", "float16", "float32")
_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_POLL_S = 0.0002


@dataclass(frozen=True)
class Sizes:
    hidden: int
    ffn: int
    vocab: int
    heads: int
    head_dim: int
    ctx: int                     # context tokens for the attention measurements
    tokens: tuple[int, ...]      # token counts of the GEMM tables
    min_time_s: float            # time spent per measured point (at least 2 runs)
    rotate_bytes: int            # weight bytes cycled through per GEMM point (defeats the caches)
    copy_bytes: int = 0          # pinned buffer of the PCIe measurements
    dtypes: tuple[str, ...] = DTYPES
    pinned: bool = False         # CPU weights in pinned memory (as the executor keeps them beside a GPU)
    kv_heads: int = 8            # key/value heads of the attention block measurement (grouped-query)

    def classes(self) -> dict[str, tuple[int, int]]:
        """Shape class -> (out_features, in_features) of its representative matrix."""
        return {"attn": (self.hidden, self.hidden), "ffn": (self.ffn, self.hidden),
                "head": (self.vocab, self.hidden)}


MiB = 1 << 20
CACHE_ROTATIONS = 4          # a rotation spans this many last-level caches: a cyclic read then hits none


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest CPU cache of this machine (Linux sysfs), or None where it cannot be read."""
    best = None
    for f in Path(root).glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            n = int(text.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        except (OSError, ValueError):
            continue
        best = n if best is None else max(best, n)
    return best


def beyond_caches(sizes: Sizes, llc: int | None = None) -> Sizes:
    """`sizes` with a rotation of at least CACHE_ROTATIONS last-level caches. Server parts carry 100-300+
    MiB of L3: a single 352 MB FFN block read over and over came back partly from the cache (156 GB/s on
    the lent H200 host's CPU against 105 GB/s over 32 distinct blocks, as a decode step reads them)."""
    llc = last_level_cache_bytes() if llc is None else llc
    if not llc:
        return sizes
    return replace(sizes, rotate_bytes=max(sizes.rotate_bytes, CACHE_ROTATIONS * llc))


CPU_QUICK = Sizes(1024, 2816, 16384, 8, 128, 1024, (1, 16, 256), 0.12, 64 * MiB, kv_heads=2)
CPU_FULL = Sizes(4096, 14336, 32768, 32, 128, 4096, (1, 4, 16, 64, 256, 1024), 0.4, 512 * MiB)
GPU_QUICK = Sizes(4096, 14336, 32768, 32, 128, 4096, (1, 4, 16, 64, 256, 1024, 4096), 0.03, 256 * MiB,
                  256 * MiB)
GPU_FULL = Sizes(4096, 14336, 128256, 32, 128, 8192, (1, 4, 16, 64, 256, 1024, 4096, 8192), 0.1, 1024 * MiB,
                 1024 * MiB)


# ---- timing -------------------------------------------------------------------------------------
def _wait(ev) -> None:
    while not ev.query():
        time.sleep(_POLL_S)


def time_host(fn: Callable[[int], object], min_time: float, min_reps: int = 3) -> float:
    """Median seconds of fn(i) on the host after one warm-up call; fewer runs when one is slow."""
    t = time.perf_counter()
    fn(0)
    if time.perf_counter() - t > min_time:
        min_reps = 2
    times: list[float] = []
    end = time.perf_counter() + min_time
    i = 1
    while len(times) < min_reps or (time.perf_counter() < end and len(times) < 10000):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
        i += 1
    return statistics.median(times)


def time_cuda(fn: Callable[[int], object], min_time: float, min_reps: int = 3) -> float:
    """Median seconds of fn(i) on the current CUDA stream, timed with events, waited on without spinning."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(0)
    done = torch.cuda.Event()
    done.record()
    _wait(done)
    times: list[float] = []
    end = time.perf_counter() + min_time
    i = 1
    while len(times) < min_reps or (time.perf_counter() < end and len(times) < 10000):
        start.record()
        fn(i)
        stop.record()
        _wait(stop)
        times.append(start.elapsed_time(stop) / 1e3)
        i += 1
    return statistics.median(times)


def _weights(shape: tuple[int, int], dtype: torch.dtype, rotate_bytes: int, device,
             pinned: bool = False) -> list[torch.Tensor]:
    """Copies of one random matrix totalling about `rotate_bytes` (pinned host memory if asked)."""
    pin = pinned and torch.device(device).type == "cpu"
    one = torch.empty(shape, dtype=dtype, device=device).uniform_(-0.05, 0.05)
    count = max(1, rotate_bytes // (one.numel() * one.element_size()))
    if not pin:
        return [one] + [one.clone() for _ in range(count - 1)]
    return [torch.empty(shape, dtype=dtype, pin_memory=True).copy_(one) for _ in range(count)]


# ---- the measurements ---------------------------------------------------------------------------
class _Steps:
    def __init__(self, total: int, progress: Progress | None, offset: float = 0.0, share: float = 1.0):
        self.total, self.done, self.progress = max(total, 1), 0, progress
        self.offset, self.share = offset, share

    def __call__(self, message: str) -> None:
        if self.progress is not None:
            self.progress(self.offset + self.share * min(self.done / self.total, 1.0), message)
        self.done += 1


def gemm_table(sizes: Sizes, device, step: _Steps) -> dict[str, dict[str, list[list[float]]]]:
    """dtype -> class -> [[tokens, achieved GFLOP/s], ...]."""
    cuda = torch.device(device).type == "cuda"
    timer = time_cuda if cuda else time_host
    out: dict[str, dict[str, list[list[float]]]] = {}
    for dtype in sizes.dtypes:
        out[dtype] = {}
        for cls, shape in sizes.classes().items():
            ws = _weights(shape, _TORCH[dtype], sizes.rotate_bytes, device, sizes.pinned)
            rows = []
            for n in sizes.tokens:
                step(f"{'gpu' if cuda else 'cpu'} matmul {dtype} {cls} x{n} tokens")
                sec = timer(_linear_fn(ws, n), sizes.min_time_s)
                rows.append([n, round(2.0 * n * shape[0] * shape[1] / sec / 1e9, 4)])
            out[dtype][cls] = rows
    return out


def _linear_fn(ws: list[torch.Tensor], n: int) -> Callable[[int], object]:
    """F.linear of n random rows against the i-th weight of `ws` (cycling)."""
    x = torch.randn(n, ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
    return lambda i: dense.linear(x, ws[i % len(ws)])


def _sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: torch.Tensor | None) -> Callable[[int], object]:
    return lambda i: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_rates(sizes: Sizes, device, step: _Steps) -> dict[str, dict[str, float]]:
    """dtype -> {"gbps": KV bytes read per second at decode, "gflops": at a prefill chunk}."""
    cuda = torch.device(device).type == "cuda"
    timer = time_cuda if cuda else time_host
    h, d, ctx = sizes.heads, sizes.head_dim, sizes.ctx
    out = {}
    for dtype in sizes.dtypes:
        step(f"{'gpu' if cuda else 'cpu'} attention {dtype}")
        dt = _TORCH[dtype]
        k = torch.randn(1, h, ctx, d, dtype=dt, device=device)
        v = torch.randn(1, h, ctx, d, dtype=dt, device=device)
        q1 = torch.randn(1, h, 1, d, dtype=dt, device=device)
        sec1 = timer(_sdpa_fn(q1, k, v, None), sizes.min_time_s)
        n = min(256 if not cuda else 1024, ctx)
        qn = torch.randn(1, h, n, d, dtype=dt, device=device)
        pos = torch.arange(ctx - n, ctx, device=device)[:, None]
        mask = (torch.arange(ctx, device=device)[None, :] <= pos)[None, None]
        secn = timer(_sdpa_fn(qn, k, v, mask), sizes.min_time_s)
        out[dtype] = {"gbps": round(2 * h * ctx * d * k.element_size() / sec1 / 1e9, 4),
                      "gflops": round(4.0 * h * d * n * ctx / secn / 1e9, 4)}
    return out


EXPERT_SHAPE = (1536, 2048)    # one gate/up matrix of a Qwen3-30B-A3B layer's expert stack (out, in)
EXPERT_ROWS = (1, 4, 16, 32, 64, 256)     # rows per expert: decode, batches, 512- to 4096-token prompts
EXPERTS_PER_JOB = 16


def experts_table(sizes: Sizes, step: _Steps, shape: tuple[int, int] = EXPERT_SHAPE) -> dict[str, list[list[float]]]:
    """dtype -> [[mean rows per expert, achieved GFLOP/s], ...] of one native job over EXPERTS_PER_JOB expert
    matrices picked from a stack (`kernels.linear_stacked` with row counts: how a step's CPU expert groups
    run, `moe._experts_batch`), cycling through a stack larger than the caches. A mean whose busiest expert
    the kernel does not take (past 16 rows without AMX tiles; no kernel at all) ends that dtype's table,
    so the estimator prices only what the engine runs natively."""
    from engine import kernels

    kernels.status(wait=True)
    n, k = shape
    out: dict[str, list[list[float]]] = {}
    # One buffer viewed as each dtype, filled with a repeated byte (about 0.01 as bf16 and float32, 1.06
    # as fp16): the arithmetic's speed does not depend on the values, and drawing random numbers over
    # this many bytes took seconds.
    nbytes = max(EXPERTS_PER_JOB * n * k * 4, sizes.rotate_bytes)
    pin = sizes.pinned and torch.cuda.is_available()
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin).fill_(0x3C)
    for dtype in sizes.dtypes:
        step(f"cpu expert jobs {dtype}")
        dt = _TORCH[dtype]
        count = nbytes // (n * k * _DTYPE_BYTES[dtype])
        stack = raw[:count * n * k * _DTYPE_BYTES[dtype]].view(dt).view(count, n, k)
        picks = [[(0, (i * EXPERTS_PER_JOB + j) % count) for j in range(EXPERTS_PER_JOB)]
                 for i in range(max(1, count // EXPERTS_PER_JOB))]
        rows = []
        for r in EXPERT_ROWS:
            # rows per expert as a step routes them: Poisson about r (at least one), not all alike (the
            # tiles pad a ragged last block of 32)
            counts = [max(1, int(c)) for c in torch.poisson(torch.full((EXPERTS_PER_JOB,), float(r)),
                                                             generator=torch.Generator().manual_seed(r))]
            job = _expert_job(stack, picks, torch.randn(sum(counts), k).to(dt), counts)
            if job(0) is None:
                break
            sec = time_host(job, sizes.min_time_s)
            rows.append([r, round(2.0 * sum(counts) * n * k / sec / 1e9, 4)])
        if rows:
            out[dtype] = rows
    return out


def _expert_job(stack: torch.Tensor, picks: list, x: torch.Tensor, counts: list[int]) -> Callable[[int], object]:
    from engine import kernels

    return lambda i: kernels.linear_stacked(x, [stack], picks[i % len(picks)], min_weights=0, counts=counts)


def op_overhead_us(device) -> float:
    """Host-side cost of one small op (launch overhead on a GPU, dispatch on the CPU), microseconds."""
    cuda = torch.device(device).type == "cuda"
    x = torch.randn(1, 64, device=device)
    w = torch.randn(64, 64, device=device)

    def burst(_i: int) -> None:
        for _ in range(100):
            F.linear(x, w)
        if cuda:
            ev = torch.cuda.Event()
            ev.record()
            _wait(ev)

    return round(time_host(burst, 0.05) / 100 * 1e6, 3)


def native_call_us() -> float:
    """Host cost of one native CPU kernel call beyond its arithmetic, microseconds: a one-row matmul over
    the smallest 16-bit matrix the native path takes (64k weights, about 10 ns of arithmetic per thread).
    0 where the native kernel is not available."""
    from engine import kernels

    kernels.status(wait=True)
    x, w = torch.randn(1, 256).to(torch.bfloat16), torch.randn(256, 256).to(torch.bfloat16)
    if not kernels.usable(x, w) or kernels.linear(x, w) is None:
        return 0.0

    def burst(_i: int) -> None:
        for _ in range(100):
            kernels.linear(x, w)

    return round(time_host(burst, 0.05) / 100 * 1e6, 3)


def memory_gbps(device, nbytes: int) -> float:
    """Read+write bandwidth of a large copy within the device (or host memory)."""
    cuda = torch.device(device).type == "cuda"
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    sec = (time_cuda if cuda else time_host)(lambda i: b.copy_(a), 0.1)
    return round(2 * nbytes / sec / 1e9, 3)


def gemv_pass(sizes: Sizes) -> tuple[Callable[[int], object], int]:
    """A bf16 decode GEMV over one FFN-shaped matrix of a set larger than the caches; (fn, bytes/call)."""
    dt = torch.bfloat16 if "bfloat16" in sizes.dtypes else _TORCH[sizes.dtypes[0]]
    ws = _weights((sizes.ffn, sizes.hidden), dt, sizes.rotate_bytes, "cpu", sizes.pinned)
    x = torch.randn(1, sizes.hidden, dtype=dt)
    return (lambda i: dense.linear(x, ws[i % len(ws)])), ws[0].numel() * ws[0].element_size()


def thread_sweep(sizes: Sizes, step: _Steps) -> dict[str, float]:
    """bf16 GEMV GB/s by CPU thread count (1, 2, 4, ... and the engine's count)."""
    engine_threads = torch.get_num_threads()
    counts = sorted({1 << i for i in range(int(math.log2(engine_threads)) + 1)} | {engine_threads})
    fn, nbytes = gemv_pass(sizes)
    out = {}
    try:
        for t in counts:
            step(f"cpu GEMV with {t} threads")
            torch.set_num_threads(t)
            out[str(t)] = round(nbytes / time_host(fn, sizes.min_time_s) / 1e9, 4)
    finally:
        torch.set_num_threads(engine_threads)
    return out


def _ffn_blocks(sizes: Sizes):
    """(run(i, x), bytes per block, dtype) over FFN blocks of the profile's shape, laid out and placed as
    the executor keeps them, cycling through more weight bytes than the caches hold; None without the
    engine's model code."""
    try:
        from engine.config import ModelConfig
        from engine.models.dense import ffn_block
    except ImportError:
        return None
    dtype = "bfloat16" if "bfloat16" in sizes.dtypes else sizes.dtypes[0]
    dt, h, f = _TORCH[dtype], sizes.hidden, sizes.ffn
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=h, intermediate_size=f, num_layers=1,
                      num_heads=1, num_kv_heads=1, head_dim=h, dtype=dtype)
    count = max(1, sizes.rotate_bytes // (3 * h * f * _DTYPE_BYTES[dtype]))
    blocks = [{"ffn_norm.weight": _weights((1, h), dt, 0, "cpu", sizes.pinned)[0][0],
               "gate_up.weight": _weights((2 * f, h), dt, 0, "cpu", sizes.pinned)[0],
               "down.weight": _weights((h, f), dt, 0, "cpu", sizes.pinned)[0]} for _ in range(count)]
    return (lambda i, x: ffn_block(cfg, blocks[i % count], x)), 3 * h * f * _DTYPE_BYTES[dtype], dtype


def ffn_block_factors(sizes: Sizes, gemm: dict, op_us: float) -> dict[str, float]:
    """Measured time of the engine's own CPU FFN block (norm, fused gate/up, SwiGLU, down) over the time the
    GEMM table and op overhead predict, at the smallest and largest token counts. The profile scales the
    CPU tables by it."""
    made = _ffn_blocks(sizes)
    if made is None:
        return {}
    run, _, dtype = made
    h, f = sizes.hidden, sizes.ffn
    rows = {int(n): r for n, r in gemm[dtype]["ffn"]}
    out = {}
    for n in (sizes.tokens[0], sizes.tokens[-1]):
        x = torch.randn(n, h, dtype=_TORCH[dtype])
        sec = time_host(lambda i, x=x: run(i, x), sizes.min_time_s)
        predicted = 6.0 * h * f * n / (rows[n] * 1e9) + 7 * op_us / 1e6
        out[str(n)] = round(min(3.0, max(0.5, sec / predicted)), 4)
    return out


ATTN_CTX = 256          # cached tokens of the attention block measurement (a short decode context)
ATTN_TOKENS = (1, 16)   # new tokens per measured attention step
# (H200 host, session 17: the one-token call took 0.57-0.93 ms where the tables price 0.85 ms of projections
# and charge 0.22 ms of ops and calls it does not make: factors of 0.4-0.83)
ATTN_FACTOR_FLOOR = 0.2


class AttentionBlocks(NamedTuple):
    cfg: object              # the ModelConfig of the measured shape (one layer per weight copy)
    run: Callable            # run(i, x [n, hidden]) -> the block's output, weight copy i % count
    nbytes: int              # weight bytes of one block
    dtype: str
    blocks: list             # each copy's weight views, as the executor packs them
    kv: object               # the PagedKVCache the blocks write and read
    seq: object              # the measured sequence (ctx cached tokens)
    steps: dict              # n -> (cos, sin, mask) of a step of n new tokens


@torch.inference_mode()
def _attention_blocks(sizes: Sizes, ctx: int = ATTN_CTX, n_max: int = max(ATTN_TOKENS),
                      interleave: bool = True, native: bool | None = None) -> AttentionBlocks:
    """Attention blocks of the profile's shape as the executor runs one sequence's step on the CPU: each
    block's weights packed in a host buffer as the executor packs them (pinned when `sizes.pinned`, the
    fused `qkv.weight` view), its new keys and values written to a paged KV cache holding `ctx` tokens
    and the context read back (with `interleave`, the sequence's blocks alternate with another's, so the
    read gathers them, as a cache shared by several sequences does), cycling through more weight bytes
    than the caches hold. x [n, hidden] at positions ctx..ctx+n-1; in inference mode, as the executor
    runs: a one-token step takes the executor's one native call (`kernels.attention_decode`) where it applies
    and `native` (default: as the executor, `SLIPSTREAM_CPU_ATTENTION_CALL`) allows; before session 17 the
    measurement always took the tensor path, which the H200 host ran in 1.32 ms against the call's 0.57-0.77,
    so the estimator priced the decode's CPU attention at about twice its cost."""
    import os

    from engine import kernels
    from engine.config import ModelConfig
    from engine.models.dense import attention_block, attention_mask
    from engine.models.rope import RotaryTable
    from engine.sharding.kvcache import BLOCK_SIZE, PagedKVCache, Sequence
    from engine.sharding.weights import SubLayerWeights

    dtype = "bfloat16" if "bfloat16" in sizes.dtypes else sizes.dtypes[0]
    dt, h = _TORCH[dtype], sizes.hidden
    kv_heads = math.gcd(sizes.heads, sizes.kv_heads)      # a divisor of heads (tiny shapes: <= heads)
    base = ModelConfig(arch="llama", vocab_size=256, hidden_size=h, intermediate_size=sizes.ffn, num_layers=1,
                       num_heads=sizes.heads, num_kv_heads=kv_heads, head_dim=sizes.head_dim, dtype=dtype)
    one = {"attn_norm.weight": torch.ones(h, dtype=dt)}
    for name, rows, cols in (("q", base.q_size, h), ("k", base.kv_size, h), ("v", base.kv_size, h),
                             ("o", h, base.q_size)):
        one[f"{name}.weight"] = torch.empty(rows, cols, dtype=dt).uniform_(-0.05, 0.05)
    nbytes = sum(t.numel() * t.element_size() for t in one.values())
    count = max(1, sizes.rotate_bytes // nbytes)
    blocks = [SubLayerWeights(f"layers.{i}.attn", one, sizes.pinned).host_views for i in range(count)]
    assert "qkv.weight" in blocks[0]
    cfg = replace(base, num_layers=count)
    kv = PagedKVCache(cfg, dt, None)
    seq, other = Sequence(), Sequence()
    while seq.length < ctx + n_max:                         # one block each in turn
        for s in (seq, other) if interleave else (seq,):
            kv.reserve(s, BLOCK_SIZE)
            s.length += BLOCK_SIZE
    seq.length = ctx
    for pool in kv.pools:
        for part in pool.parts:
            part.normal_(0.0, 0.5)
    rope, gqa = RotaryTable(cfg), cfg.num_kv_heads != cfg.num_heads
    if native is None:
        native = os.environ.get("SLIPSTREAM_CPU_ATTENTION_CALL", "1") != "0"
    steps = {}
    for n in range(1, n_max + 1):
        steps[n] = (*rope.cos_sin(torch.arange(ctx, ctx + n), torch.device("cpu"), dt),
                    attention_mask(n, ctx, None, "cpu"))

    def run(i: int, x: torch.Tensor) -> torch.Tensor:
        layer, n = i % count, x.shape[0]
        cos, sin, mask = steps[n]

        def attend(q, k, v):           # the executor's one-sequence attention (Executor._attention)
            kv.write_many(layer, [(seq, ctx, n)], k, v)
            if n == 1 and mask is None:
                out = kv.attend_decode(layer, [(seq, ctx + 1)], q)
                if out is not None:
                    return out
            keys, values = kv.read(layer, seq, ctx + n)
            return dense._attend(q, keys, values, mask, gqa)

        with torch.inference_mode():
            pool = kv.pools[layer]
            if native and n == 1 and mask is None and pool.parts is not None and not pool.fp8:
                # the executor's one-token CPU attention: one native call where it applies
                y = kernels.attention_decode(x, blocks[layer], cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads,
                                             cos[0], sin[0], pool.parts[0], pool.parts[1],
                                             kv.decode_table(seq, ctx + 1), ctx)
                if y is not None:
                    return y
            return attention_block(cfg, blocks[layer], x, cos, sin, None, None, None, attend=attend)

    return AttentionBlocks(cfg, run, nbytes, dtype, blocks, kv, seq, steps)


def attn_block_factors(sizes: Sizes, sec: dict, ctx: int = ATTN_CTX) -> dict:
    """The engine's own CPU attention block (norm, fused qkv, rope, paged KV write and read, attention, o)
    timed at one and a few new tokens over `ctx` cached ones. Returns {"factor": {n: f}, "detail": ...}:
    f scales the CPU "attn" GEMM table (in place of the FFN `block_factor`) so that the estimator's CPU
    attention sub-layer (`estimator.attention_parts_ms` plus its op overhead, from this section's rates)
    takes the measured time; clamped to [ATTN_FACTOR_FLOOR, 3]. Over several tokens (the tensor path) the
    extra over the GEMM-table prediction is PyTorch op overhead (the KV gather, attention, rope and norm ops)
    that the per-op charge does not cover; a one-token block is one native call that pays none of the
    charged ops, so its factor may sit well below 1."""
    from engine.sharding.estimator import NATIVE_CALLS, OPS, attention_parts_ms
    from engine.sharding.profile import ProfileDatabase
    from engine.sharding.spec import ModelSpec

    cfg, run, _, dtype, *_ = _attention_blocks(sizes, ctx)
    sub = next(s for s in ModelSpec.from_config(replace(cfg, num_layers=1)).sublayers if s.kind == "attn")
    raw = ProfileDatabase({"device": "cpu", "cpu": {k: v for k, v in sec.items()
                                                     if k not in ("block_factor", "attn_block_factor")}})
    factor, measured, predicted = {}, {}, {}
    for n in ATTN_TOKENS:
        x = torch.randn(n, sizes.hidden, dtype=_TORCH[dtype])
        ms = time_host(lambda i, x=x: run(i, x), sizes.min_time_s) * 1e3
        proj, attend = attention_parts_ms(raw, "cpu", dtype, sub, n, ctx + n)
        rest = attend + raw.op_ms("cpu", OPS["cpu"]["attn"]) + NATIVE_CALLS["attn"] * raw.native_call_ms
        factor[str(n)] = round(min(3.0, max(ATTN_FACTOR_FLOOR, (ms - rest) / proj)), 4)
        measured[str(n)], predicted[str(n)] = round(ms, 4), round(proj + rest, 4)
    return {"factor": factor, "detail": {"ctx": ctx, "kv_heads": cfg.num_kv_heads, "measured_ms": measured,
                                         "predicted_ms": predicted}}


IDLE_S = 0.002     # a GPU stretch between two CPU sub-layers of a mixed decode plan (attention, a copy wait)


def ffn_block_after_idle(sizes: Sizes, reps: int = 24) -> dict[str, float]:
    """A one-token FFN block back to back ("hot") and after `IDLE_S` of sleep ("after idle"), as a decode
    step of a mixed plan runs it: between two CPU sub-layers the GPU works and the CPU's matmul threads
    go to sleep, so each CPU sub-layer starts by waking them (slow on virtual machines and busy
    desktops). The estimator adds the difference to every GPU -> CPU crossing."""
    made = _ffn_blocks(sizes)
    if made is None:
        return {}
    run, nbytes, dtype = made
    x = torch.randn(1, sizes.hidden, dtype=_TORCH[dtype])
    hot = time_host(lambda i: run(i, x), sizes.min_time_s)
    times = []
    run(0, x)
    for i in range(1, reps + 1):
        time.sleep(IDLE_S)
        t = time.perf_counter()
        run(i, x)
        times.append(time.perf_counter() - t)
    idle = statistics.median(times)
    return {"hot_ms": round(hot * 1e3, 4), "after_idle_ms": round(idle * 1e3, 4), "idle_s": IDLE_S,
            "block_bytes": nbytes}


def ffn_block_pass(sizes: Sizes):
    """(fn(i), bytes per call) running one-token FFN blocks, or None (for the link measurements)."""
    made = _ffn_blocks(sizes)
    if made is None:
        return None
    run, nbytes, dtype = made
    x = torch.randn(1, sizes.hidden, dtype=_TORCH[dtype])
    return (lambda i: run(i, x)), nbytes


def device_section(sizes: Sizes, device, step: _Steps) -> dict:
    cuda = torch.device(device).type == "cuda"
    sec = {"gemm": gemm_table(sizes, device, step), "attention": attention_rates(sizes, device, step)}
    step(f"{'gpu' if cuda else 'cpu'} op overhead and memory bandwidth")
    sec["op_overhead_us"] = op_overhead_us(device)
    sec["mem_gbps"] = memory_gbps(device, min(sizes.rotate_bytes, 256 * MiB))
    sec["shapes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(sizes).items()}
    return sec


def cpu_section(sizes: Sizes, progress: Progress | None, offset: float = 0.0, share: float = 1.0) -> dict:
    n_steps = len(sizes.dtypes) * (3 * len(sizes.tokens) + 2) + 3 + 7
    step = _Steps(n_steps, progress, offset, share)
    sec = device_section(sizes, "cpu", step)
    sec["native_call_us"] = native_call_us()
    sec["experts"] = experts_table(sizes, step)
    step("cpu FFN block as the engine runs it")
    sec["block_factor"] = ffn_block_factors(sizes, sec["gemm"], sec["op_overhead_us"])
    step("cpu attention block as the engine runs it")
    attn = attn_block_factors(sizes, sec)
    sec["attn_block_factor"], sec["attn_block"] = attn["factor"], attn["detail"]
    step("cpu FFN block after an idle gap")
    sec["ffn_block_idle"] = ffn_block_after_idle(sizes)
    sec["threads"] = torch.get_num_threads()
    sec["pinned_weights"] = sizes.pinned
    sec["threads_gbps"] = thread_sweep(sizes, step)
    return sec


# ---- adding one measurement to a stored profile -------------------------------------------------
def stored_sizes(shapes: dict) -> Sizes:
    """The `Sizes` a profile section was measured with (its "shapes"; fields it predates keep defaults)."""
    known = {f.name for f in fields(Sizes)}
    return Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in shapes.items() if k in known})


def update_attn_block(path: Path, key: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Measure the engine's CPU attention block on this machine with the shapes, thread count and rates
    of a stored profile (entry `key`, default the first, which `--profile-file` reads) and write its
    `attn_block_factor` into that entry of the profile database at `path`, in place. Returns the entry."""
    import json
    import os
    from datetime import datetime, timezone

    from engine import kernels
    from engine.sharding import profile_store

    db = json.loads(Path(path).read_text(encoding="utf-8"))
    if db.get("schema") != profile_store.SCHEMA or not db.get("profiles"):
        raise ValueError(f"{path}: not a profile database of schema {profile_store.SCHEMA}")
    key = key or next(iter(db["profiles"]))
    entry = db["profiles"][key]
    sec = entry["cpu"]
    sizes = stored_sizes(sec["shapes"])
    if sizes.pinned and not torch.cuda.is_available():
        log("no CUDA here: weights in pageable memory (the profile's were pinned)")
        sizes = replace(sizes, pinned=False)
    threads = torch.get_num_threads()
    want = int(sec.get("threads") or threads)
    if want != threads and want <= (os.cpu_count() or want):
        torch.set_num_threads(want)
    log(f"profile {key}: CPU matmul now {kernels.status(wait=True)}; "
        f"profile's fingerprint: {entry.get('fingerprint', {}).get('cpu_matmul', '?')}")
    try:
        attn = attn_block_factors(sizes, sec)
    finally:
        torch.set_num_threads(threads)
    detail = dict(attn["detail"], added=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    log(f"attention block over {detail['ctx']} tokens: measured {detail['measured_ms']} ms, tables "
        f"predicted {detail['predicted_ms']} ms -> attn_block_factor {attn['factor']} "
        f"(was {sec.get('attn_block_factor')})")
    entry["cpu"] = dict(sec, attn_block_factor=attn["factor"], attn_block=detail)
    profile_store.replace_profile(Path(path), key, entry)
    return entry


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Add one measurement to a stored profile database file.")
    ap.add_argument("--attn-block", action="store_true", required=True,
                    help="the engine's CPU attention block (attn_block_factor of the CPU section)")
    ap.add_argument("--update", required=True, metavar="PATH", help="profile database file to update in place")
    ap.add_argument("--key", default=None, help="profile entry (default: the first)")
    args = ap.parse_args(argv)
    update_attn_block(Path(args.update), args.key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
