"""Where a one-token CPU attention block's time goes, without a profiler (whose per-op cost inflates the
small ops): the engine's block as the executor runs it (paged KV cache write and read, fused qkv), and
each of its parts timed alone in a loop, at a given context length; also the whole block with PyTorch
limited to one thread (the native matmuls keep their own pool), to see what waking PyTorch's threads
for small ops costs.

    python -m engine.bench.cpu_attention_parts --ctx 256 --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report
from engine.config import ModelConfig
from engine.models import dense
from engine.models.rope import apply_rotary
from engine.sharding.device import host_buffers
from engine.sharding.kvcache import PagedKVCache, Sequence


def timed(fn, reps: int) -> float:
    """Median milliseconds of `fn(i)` over `reps` calls (after a few warm-up calls)."""
    for i in range(3):
        fn(i)
    out = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def make_blocks(cfg: ModelConfig, count: int, pin: bool) -> list[dict[str, torch.Tensor]]:
    """`count` attention weight dicts in the executor's fused layout, each in its own host buffer."""
    dt, h = torch.bfloat16, cfg.hidden_size
    shapes = {"attn_norm.weight": (h,), "qkv.weight": (cfg.q_size + 2 * cfg.kv_size, h), "o.weight": (h, cfg.q_size)}
    blocks = []
    for _ in range(count):
        w = {}
        for name, shape in shapes.items():
            n = 1
            for s in shape:
                n *= s
            t = host_buffers([2 * n], pin)[0].view(dt).view(shape)
            t.normal_(0, 0.02)
            w[name] = t
        blocks.append(w)
    return blocks


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=256, help="cached tokens the new token attends over")
    ap.add_argument("--blocks", type=int, default=16, help="weight copies cycled (more bytes than the caches)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cfg = ModelConfig(arch="llama", vocab_size=256, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_layers=1, num_heads=args.heads, num_kv_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, dtype="bfloat16")
    pin = torch.cuda.is_available()
    blocks = make_blocks(cfg, args.blocks, pin)
    kv = PagedKVCache(cfg, torch.bfloat16, None)
    seq = Sequence()
    kv.reserve(seq, args.ctx + 1)
    kv.write(0, seq, 0, torch.randn(cfg.num_kv_heads, args.ctx, cfg.head_dim).bfloat16(),
             torch.randn(cfg.num_kv_heads, args.ctx, cfg.head_dim).bfloat16())
    seq.length = args.ctx
    x = torch.randn(1, cfg.hidden_size).bfloat16()
    pos = torch.tensor([args.ctx])
    freqs = 1.0 / (10000 ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    ang = pos[:, None].float() * freqs[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).bfloat16()
    sin = torch.cat([ang.sin(), ang.sin()], -1).bfloat16()
    gqa = cfg.num_kv_heads != cfg.num_heads
    segs = [(seq, args.ctx, 1)]

    def attend(q, k, v):
        kv.write_many(0, segs, k, v)
        keys, values = kv.read(0, seq, args.ctx + 1)
        return dense._attend(q, keys, values, None, gqa)

    def block(i):
        return dense.attention_block(cfg, blocks[i % len(blocks)], x, cos, sin, None, None, None, attend=attend)

    q = torch.randn(cfg.num_heads, 1, cfg.head_dim).bfloat16()
    k = torch.randn(cfg.num_kv_heads, 1, cfg.head_dim).bfloat16()
    qk = torch.cat([q, k])
    h = dense.rms_norm(x, blocks[0]["attn_norm.weight"], 1e-5)
    keys, values = kv.read(0, seq, args.ctx + 1)
    attn_out = torch.randn(1, cfg.q_size).bfloat16()
    parts = {
        "block": block,
        "rms_norm": lambda i: dense.rms_norm(x, blocks[i % len(blocks)]["attn_norm.weight"], 1e-5),
        "qkv linear": lambda i: dense.linear(h, blocks[i % len(blocks)]["qkv.weight"]),
        "rope q and k": lambda i: apply_rotary(qk, cos, sin),     # both at once, as the block runs it
        "kv write": lambda i: kv.write_many(0, segs, k, k),
        "kv read": lambda i: kv.read(0, seq, args.ctx + 1),
        "sdpa": lambda i: dense._attend(q, keys, values, None, gqa),
        "o linear": lambda i: dense.linear(attn_out, blocks[i % len(blocks)]["o.weight"]),
    }
    rows = {name: timed(fn, args.reps) for name, fn in parts.items()}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        block(0)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None)   # top-level PyTorch ops of one block
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows["block, PyTorch on 1 thread"] = timed(block, args.reps)
    finally:
        torch.set_num_threads(threads)
    nbytes = sum(t.numel() * 2 for t in blocks[0].values())
    print(f"one-token CPU attention block, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
          f"ctx {args.ctx}, {threads} threads, weights {nbytes / 1e6:.0f} MB "
          f"({'page-locked' if pin else 'pageable'})")
    for name, ms in rows.items():
        print(f"  {name:28s} {ms * 1e3:8.0f} us")
    parts_sum = sum(v for n, v in rows.items() if n not in ("block", "block, PyTorch on 1 thread"))
    print(f"  {'sum of the parts':28s} {parts_sum * 1e3:8.0f} us; block at {nbytes / rows['block'] / 1e6:.0f} GB/s, "
          f"{ops} top-level PyTorch ops")
    if args.out is not None:
        write_report(args.out, "cpu_attention_parts", {"ctx": args.ctx, "threads": threads, "weights_bytes": nbytes,
                                                       "ms": rows, "ops_per_block": ops},
                     " ".join(["python -m engine.bench.cpu_attention_parts", *(argv or sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
