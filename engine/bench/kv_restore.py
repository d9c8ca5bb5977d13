"""Restore time of a long context from the host-RAM KV tier, against recomputing it (prefill).

    python -m engine.bench.kv_restore --shape llama3-8b --budget 4GiB --tokens 4096 --out docs/benchmarks/gpu
    python -m engine.bench.kv_restore --device sim --shape tiny --tokens 512      (a check on the CPU)

Random weights of the named shape; the budget is the engine's own VRAM accounting. For a context of
--tokens tokens it times:
  - recompute: the prefill of the whole context, under the engine's plan for the budget;
  - offload / restore: `PagedKVCache.offload` of the sequence (VRAM -> host tier) and `restore` (back);
  - switch back: the conversation's cached blocks are moved out of VRAM (`evict_cached`), then a new
    turn's `match_prefix` finds them in the host tier and copies them back, as a chat that returns to an
    older conversation does.
After every restore the next token's logits are computed and compared with those computed before the
move (they must be equal bit for bit). `--kv-dtype fp8` measures the fp8 cache. Medians of --reps runs; the first offload (which also allocates the
pinned host chunks) is reported apart. Writes kv_restore.json under --out.
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
from engine.sharding.kvcache import BLOCK_SIZE, Sequence

TINY = ModelConfig(arch="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                   num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=16384,
                   dtype="float32")


def open_engine(shape: str, device: str, budget, tokens: int, host_gib: float, kv_dtype: str | None = None):
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = TINY if shape == "tiny" else get_shape(shape)
    eng = TorchEngine(random_model(cfg, seed=0, name=shape), device=device, vram_budget=budget,
                      n_ctx=tokens + 2 * BLOCK_SIZE, host_kv_gib=host_gib, speculative=False,
                      kv_dtype=kv_dtype)
    eng._ensure_kv_capacity(tokens + BLOCK_SIZE)       # plan for the whole context from the start
    return eng


class Timer:
    def __init__(self, eng):
        self.eng = eng

    def sync(self) -> None:
        if self.eng.accel is not None:
            self.eng.accel.synchronize()

    def __call__(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, (time.perf_counter() - t0) * 1e3


def next_logits(eng, seq: Sequence, token: int) -> torch.Tensor:
    """The logits of one more token after `seq`, which is then cut back to where it was."""
    length = seq.length
    out = eng._step(seq, [token], False)[-1].clone()
    eng.executor.kv.truncate(seq, length)
    return out


@torch.inference_mode()
def measure(eng, tokens: int, reps: int, seed: int = 0) -> dict:
    kv, timer = eng.executor.kv, Timer(eng)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(eng.config.vocab_size, 32000), (tokens,), generator=g).tolist()
    probe = ids[-1]
    recompute, seq = [], None
    for _ in range(reps):
        if seq is not None:
            kv.release(seq)
        seq = Sequence(cacheable=False)          # private blocks: every offload copies all of them
        _, ms = timer(lambda s=seq: eng._run(s, ids, False))
        recompute.append(ms)
    want = next_logits(eng, seq, probe)
    n_blocks = len(seq.block_table)
    offload, restore, same = [], [], []
    for _ in range(reps + 1):
        ok, ms = timer(lambda: kv.offload(seq))
        if not ok:
            raise SystemExit("the host tier has no room for the context: raise --host-gib")
        offload.append(ms)
        _, ms = timer(lambda: kv.restore(seq))
        restore.append(ms)
        same.append(torch.equal(next_logits(eng, seq, probe), want))
    kv.release(seq)
    # A conversation left cached, moved out of VRAM, then found again by the next turn's prefix lookup.
    first = Sequence()
    eng._run(first, ids, False)
    kv.release(first)
    switch, hit_tokens = [], []
    for _ in range(reps):
        kv.evict_cached()
        turn = Sequence()
        common, ms = timer(lambda t=turn: kv.match_prefix(t, ids + [probe]))
        switch.append(ms)
        hit_tokens.append(common)
        kv.release(turn)
    slot_bytes = kv.host.slot_bytes
    moved = n_blocks * slot_bytes
    med = statistics.median
    return {
        "tokens": tokens, "blocks": n_blocks, "kv_bytes": moved,
        "plan": eng.executor.plan.kind if eng.executor.plan else None,
        "attention_layers_on_gpu": sum(p.on_gpu for p in kv.pools), "layers": len(kv.pools),
        "recompute_ms": med(recompute), "recompute_ms_all": recompute,
        "first_offload_ms": offload[0], "offload_ms": med(offload[1:]), "restore_ms": med(restore),
        "offload_ms_all": offload, "restore_ms_all": restore,
        "switch_back_ms": med(switch), "switch_back_ms_all": switch,
        "switch_back_hit_tokens": hit_tokens[-1],
        "restore_gbps": moved / (med(restore) / 1e3) / 1e9,
        "restore_speedup_vs_recompute": med(recompute) / med(restore),
        "switch_back_speedup_vs_recompute": med(recompute) / med(switch),
        "logits_identical_after_restore": all(same),
        "host_kv": kv.host_report(), "pinned_host_memory": kv.host.pin,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", help="a named shape (engine.bench.shapes) or 'tiny'")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--host-gib", type=float, default=4.0)
    ap.add_argument("--kv-dtype", default=None, choices=["fp8"], help="fp8: the e4m3 KV cache")
    ap.add_argument("--out", default="docs/benchmarks/gpu")
    args = ap.parse_args(argv)
    eng = open_engine(args.shape, args.device, args.budget, args.tokens, args.host_gib, args.kv_dtype)
    try:
        res = measure(eng, args.tokens, args.reps)
    finally:
        eng.close()
    print(f"{args.shape} on {args.device}, budget {args.budget}, plan {res['plan']} "
          f"({res['attention_layers_on_gpu']}/{res['layers']} layers' KV in VRAM)")
    print(f"context {res['tokens']} tokens = {res['blocks']} blocks, {res['kv_bytes'] / 2**20:.1f} MiB of KV")
    rows = [("recompute (prefill)", res["recompute_ms"]), ("offload to host", res["offload_ms"]),
            ("first offload (allocates)", res["first_offload_ms"]), ("restore from host", res["restore_ms"]),
            ("switch back (prefix hit)", res["switch_back_ms"])]
    for name, ms in rows:
        print(f"  {name:28s} {ms:10.2f} ms")
    print(f"  restore {res['restore_gbps']:.1f} GB/s, {res['restore_speedup_vs_recompute']:.1f}x faster than "
          f"recompute; logits identical after restore: {res['logits_identical_after_restore']}")
    payload = {"shape": args.shape, "device": args.device, "budget": args.budget,
               "kv_dtype": args.kv_dtype or "model", **res}
    path = write_report(Path(args.out), "kv_restore", payload,
                        " ".join(["python -m engine.bench.kv_restore"] + (argv or sys.argv[1:])))
    print(f"wrote {path}")
    return 0 if res["logits_identical_after_restore"] else 1


if __name__ == "__main__":
    sys.exit(main())
