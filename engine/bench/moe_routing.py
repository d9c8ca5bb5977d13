"""How a MoE shape's benchmark weights route tokens: per layer, the experts touched and the busiest ones' share.

    python -m engine.bench.moe_routing [--shape qwen3-30b-a3b] [--layers 4] [--tokens 256] [--gguf]
    python -m engine.bench.moe_routing --layers 24 --moe-intermediate 192 --vocab 4096   # deep, narrower

Benchmarks run random weights, and a MoE layer's routing depends on their values: a trained model spreads
its tokens over the experts, so a benchmark must too. This draws the shape's random model twice, with
the benchmark deviations (`random_init.random_std`) and with every matrix at 0.02 (the weights before
session 13), scores `--tokens` random token ids once on the CPU and counts, per MoE layer, the experts
`moe.route` picks. With `--gguf` it does the same through the GGUF the llama.cpp baseline reads
(`gguf_shapes.write_gguf`, F16, read back by the engine, which computes what llama.cpp computes from it).
Prints a table and writes docs/benchmarks/<--name>.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import tempfile
from pathlib import Path

import numpy as np

from engine.bench.gpu_common import write_report


@contextlib.contextmanager
def flat_weights(flat: bool):
    """With `flat`, every benchmark matrix drawn at 0.02 (`random_std` patched) for the duration."""
    from engine.loading import random_init

    real = random_init.random_std
    if flat:
        random_init.random_std = lambda name: random_init.WEIGHT_STD
    try:
        yield
    finally:
        random_init.random_std = real


def count_routing(eng, ids: list[int], n_layers: int) -> list[collections.Counter]:
    """Each MoE layer's expert counts over one forward pass of `ids` (`moe.route` wrapped)."""
    from engine.models import moe

    hits = [collections.Counter() for _ in range(n_layers)]
    calls = [0]
    route = moe.route

    def counting(cfg, logits, dtype=None):
        w, i = route(cfg, logits, dtype)
        hits[calls[0] % n_layers].update(i.reshape(-1).tolist())
        calls[0] += 1
        return w, i

    moe.route = counting
    try:
        eng.score(ids)
    finally:
        moe.route = route
    return hits


def summary(hits: list[collections.Counter], n_experts: int, top: int) -> list[dict]:
    out = []
    for layer, c in enumerate(hits):
        total = sum(c.values()) or 1
        out.append({"layer": layer, "experts_touched": len(c), "of": n_experts,
                    f"top{top}_share": round(sum(v for _, v in c.most_common(top)) / total, 3),
                    "busiest_pairs": c.most_common(1)[0][1] if c else 0, "pairs": total})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--moe-intermediate", type=int, default=0, help="narrow the experts (0: the shape's)")
    ap.add_argument("--vocab", type=int, default=0, help="a smaller vocabulary (0: the shape's)")
    ap.add_argument("--gguf", action="store_true", help="also through the GGUF the llama.cpp baseline reads")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--name", default="moe_routing", help="the report's file name, without .json")
    args = ap.parse_args(argv)

    from engine.backends.torch_engine import TorchEngine
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = dataclasses.replace(get_shape(args.shape), num_layers=args.layers)
    if args.moe_intermediate:
        cfg = dataclasses.replace(cfg, moe_intermediate_size=args.moe_intermediate)
    if args.vocab:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, args.tokens).tolist()
    top = cfg.num_experts_per_tok
    results = {}
    for flat in (True, False):
        label = "every matrix at 0.02" if flat else "random_std"
        with flat_weights(flat):
            eng = TorchEngine(random_model(cfg, seed=0), device="cpu", n_ctx=args.tokens + 64)
        results[f"random_model, {label}"] = summary(count_routing(eng, ids, cfg.num_layers), cfg.num_experts, top)
        eng.close()
        if args.gguf:
            results[f"GGUF, {label}"] = _through_gguf(cfg, ids, flat, top)
    print(f"{args.shape}: {cfg.num_layers} layers, {cfg.num_experts} experts (top {top}), {args.tokens} random tokens")
    print(f"{'weights':<44} " + " ".join(f"L{r['layer']:<9}" for r in next(iter(results.values()))))
    for label, rows in results.items():
        print(f"{label:<44} " + " ".join(f"{r['experts_touched']:>3}/{r[f'top{top}_share']:<6.2f}" for r in rows))
    print("(per layer: experts touched / share of the pairs taken by the busiest top-k experts)")
    path = write_report(Path(args.out), args.name, {"shape": args.shape, "config": {
        "layers": cfg.num_layers, "experts": cfg.num_experts, "top_k": top, "hidden": cfg.hidden_size,
        "moe_intermediate": cfg.moe_intermediate_size, "vocab": cfg.vocab_size}, "tokens": args.tokens,
        "results": results}, " ".join(["python -m engine.bench.moe_routing"] + (argv or sys.argv[1:])))
    print(f"wrote {path}")
    return 0


def _through_gguf(cfg, ids: list[int], flat: bool, top: int) -> list[dict]:
    """The shape written as the llama.cpp baseline's GGUF (F16; with `flat`, the one draw at 0.02 of before),
    read back by the engine."""
    import engine
    from engine.bench.gguf_shapes import write_gguf

    with tempfile.TemporaryDirectory() as d:
        with flat_weights(flat):
            facts = write_gguf(gguf_moe_shape(cfg), Path(d) / "moe.gguf", None, "f16")
        eng = engine.open_model(facts["path"], device="cpu", backend="torch")
        try:
            return summary(count_routing(eng, ids, cfg.num_layers), cfg.num_experts, top)
        finally:
            eng.close()


def gguf_moe_shape(cfg):
    """The GGUF writer's qwen3moe shape of a qwen3_moe `ModelConfig`."""
    from engine.bench.gguf_shapes import GgufShape

    c = cfg
    return GgufShape("qwen3moe", c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                     c.num_kv_heads, c.head_dim, c.rope_theta, c.rms_norm_eps, 2048, experts=c.num_experts,
                     experts_used=c.num_experts_per_tok, expert_ffn=c.moe_intermediate_size)


if __name__ == "__main__":
    sys.exit(main())
