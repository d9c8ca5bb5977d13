"""Where a one-token CPU attention block's time goes, without a profiler (whose per-op cost inflates the
small ops): the engine's block as the executor runs it (paged KV cache write and read, fused qkv), and
each of its parts timed alone in a loop, at a given context length, and the top-level PyTorch ops one
block runs. The block is timed two ways, call by call in turn: attention through PyTorch (the pool read,
gathered where the sequence's blocks are not one run, and SDPA), and through the native paged kernel the
executor now uses (`kernels.paged_decode_attention`, the pool read in place); `--scattered` interleaves
the sequence's blocks with another's, as a pool that has handed out freed blocks does.

    python -m engine.bench.cpu_attention_parts --ctx 256 --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import kernels
from engine.bench.gpu_common import write_report
from engine.models import dense
from engine.models.rope import apply_rotary
from engine.sharding.measure import Sizes, _attention_blocks


def timed(fn, reps: int) -> float:
    """Median milliseconds of `fn(i)` over `reps` calls (after a few warm-up calls)."""
    return timed_turns([fn], reps)[0]


def timed_turns(fns: list, reps: int) -> list[float]:
    """Median milliseconds of each `fn(i)` over `reps` calls, the functions taking turns call by call, so
    that a machine's drift (other load, clocks) reaches each alike."""
    for i in range(3):
        for fn in fns:
            fn(i)
    out: list[list[float]] = [[] for _ in fns]
    for i in range(reps):
        for fn, times in zip(fns, out):
            t = time.perf_counter()
            fn(i)
            times.append(time.perf_counter() - t)
    return [statistics.median(times) * 1e3 for times in out]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=256, help="cached tokens the new token attends over")
    ap.add_argument("--blocks", type=int, default=16, help="weight copies cycled (more bytes than the caches)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--scattered", action="store_true", help="the sequence's blocks not consecutive in the pool")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    d = args.hidden // args.heads
    one_block = 2 * (args.hidden + (args.heads + 2 * args.kv_heads) * d * args.hidden + args.hidden * args.heads * d)
    # The profile's own attention block measurement (engine.sharding.measure), one sequence's blocks in a run
    # unless --scattered
    sizes = Sizes(args.hidden, 4 * args.hidden, 256, args.heads, d, args.ctx, (1,), 0.1, args.blocks * one_block,
                  dtypes=("bfloat16",), pinned=torch.cuda.is_available(), kv_heads=args.kv_heads)
    ab = _attention_blocks(sizes, args.ctx, 1, interleave=args.scattered, native=False)   # (the tensor path's parts)
    cfg, blocks, kv, seq = ab.cfg, ab.blocks, ab.kv, ab.seq
    cos, sin, _ = ab.steps[1]
    gqa = cfg.num_kv_heads != cfg.num_heads
    x = torch.randn(1, cfg.hidden_size).bfloat16()
    segs = [(seq, args.ctx, 1)]
    q = torch.randn(cfg.num_heads, 1, cfg.head_dim).bfloat16()
    k = torch.randn(cfg.num_kv_heads, 1, cfg.head_dim).bfloat16()
    qk = torch.cat([q, k])
    h = dense.rms_norm(x, blocks[0]["attn_norm.weight"], 1e-5)
    keys, values = kv.read(0, seq, args.ctx + 1)
    attn_out = torch.randn(1, cfg.q_size).bfloat16()
    block = (lambda i: ab.run(i, x))
    parts = {
        "rms_norm": lambda i: dense.rms_norm(x, blocks[i % len(blocks)]["attn_norm.weight"], 1e-5),
        "qkv linear": lambda i: dense.linear(h, blocks[i % len(blocks)]["qkv.weight"]),
        "rope q and k": lambda i: apply_rotary(qk, cos, sin),     # both at once, as the block runs it
        "kv write": lambda i: kv.write_many(0, segs, k, k),
        "kv read": lambda i: kv.read(0, seq, args.ctx + 1),
        "sdpa": lambda i: dense._attend(q, keys, values, None, gqa),
        "o linear": lambda i: dense.linear(attn_out, blocks[i % len(blocks)]["o.weight"]),
    }
    native = kernels.attention_ready() and kv.attend_decode(0, [(seq, args.ctx + 1)], q) is not None

    def with_attention(native: bool):
        def run(i):
            kernels.set_attention_enabled(native)
            return block(i)
        return run

    was = kernels.set_attention_enabled(False)
    try:   # the two blocks take turns (the old one's parts alone after them)
        old_ms, new_ms = timed_turns([with_attention(False), with_attention(True)], args.reps)
        kernels.set_attention_enabled(False)
        rows = {"block": old_ms, **{name: timed(fn, args.reps) for name, fn in parts.items()}}
        ops = _ops(block)
        kernels.set_attention_enabled(True)
        new_rows = {"native attention": timed(lambda i: kv.attend_decode(0, [(seq, args.ctx + 1)], q), args.reps)
                    if native else None, "block, native attention": new_ms}
        new_ops = _ops(block)
    finally:
        kernels.set_attention_enabled(was)
    threads = torch.get_num_threads()
    nbytes = ab.nbytes
    print(f"one-token CPU attention block, hidden {cfg.hidden_size}, {cfg.num_heads}/{cfg.num_kv_heads} heads, "
          f"ctx {args.ctx}, {threads} threads, weights {nbytes / 1e6:.0f} MB "
          f"({'pinned' if sizes.pinned else 'pageable'}), the sequence's blocks "
          f"{'scattered' if args.scattered else 'in one run'}")
    for name, ms in rows.items():
        print(f"  {name:28s} {ms * 1e3:8.0f} us")
    parts_sum = sum(v for n, v in rows.items() if n != "block")
    print(f"  {'sum of the parts':28s} {parts_sum * 1e3:8.0f} us; block at {nbytes / rows['block'] / 1e6:.0f} GB/s, "
          f"{ops} top-level PyTorch ops")
    if not native:
        print(f"  (no native attention: {kernels.status()}; the second block runs PyTorch's attention too)")
    else:
        print(f"  {'native attention':28s} {new_rows['native attention'] * 1e3:8.0f} us  (in place of kv read + sdpa)")
    block_new = new_rows["block, native attention"]
    print(f"  {'block, native attention':28s} {block_new * 1e3:8.0f} us; at {nbytes / block_new / 1e6:.0f} GB/s, "
          f"{new_ops} top-level PyTorch ops")
    if args.out is not None:
        write_report(args.out, "cpu_attention_parts",
                     {"ctx": args.ctx, "threads": threads, "weights_bytes": nbytes, "scattered": args.scattered,
                      "ms": {**rows, **{k: v for k, v in new_rows.items() if v is not None}},
                      "ops_per_block": ops, "ops_per_block_native": new_ops},
                     " ".join(["python -m engine.bench.cpu_attention_parts", *(argv or sys.argv[1:])]))
    return 0


def _ops(block) -> int:
    """Top-level PyTorch ops of one block."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        block(0)
    return sum(1 for e in prof.events() if e.cpu_parent is None)


if __name__ == "__main__":
    raise SystemExit(main())
