"""CPU decode with and without the executor's native layer calls, alternating in one engine.

    python -m engine.bench.cpu_calls_ab --shape smollm2-135m --out docs/benchmarks
    python -m engine.bench.cpu_calls_ab --shape qwen3-30b-a3b --layers 2 --out docs/benchmarks

A random-weight model of a named shape in bf16 (`--layers`: keep that many), every sub-layer on the CPU
(device "cpu"). Greedy decode of `--tokens` tokens after a short prompt, `--rounds` rounds, each round
once with the calls on and once off (the order alternating): the one-token attention call
(`kernels.attention_decode`), the dense FFN call (`kernels.ffn_layer`) and, for a MoE shape, the MoE layer
call (`moe.layer_cpu`). Reports the
milliseconds per token of each run, their medians, and whether both ways gave the same tokens. Writes a
table and cpu_calls_ab_<shape>.json (command, machine, date).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report


def ms_per_token(eng, tokens: int) -> tuple[float, list[int]]:
    eng.executor.kv.forget_cached()     # (the same prompt each run: all of it computed, the same steps each way)
    stamps, ids = [], []
    for ev in eng.generate("hello world " * 8, max_new_tokens=tokens + 1, temperature=0.0):
        if ev.token_id is not None:
            stamps.append(time.perf_counter())
            ids.append(ev.token_id)
    return (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1) * 1e3, ids


def set_calls(eng, on: bool) -> None:
    from engine import kernels

    eng.executor.cpu_attention_call = on
    eng.executor.cpu_moe_layer = on
    kernels.set_ffn_call(on)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.cpu_calls_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=0, help="keep this many layers (0: all)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args(argv)

    from engine import kernels
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.scenarios import DRY_CONFIGS
    from engine.bench.shapes import get_shape
    from engine.loading.random_init import random_model

    cfg = DRY_CONFIGS[args.shape]() if args.shape in DRY_CONFIGS else get_shape(args.shape)
    cfg = dataclasses.replace(cfg, dtype="bfloat16", **({"num_layers": args.layers} if args.layers else {}))
    eng = TorchEngine(random_model(cfg, seed=0, name=args.shape), device="cpu", speculative=False)
    runs: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {}
    try:
        for on in (True, False):                         # warm-up, both ways
            set_calls(eng, on)
            ms_per_token(eng, 4)
        for r in range(args.rounds):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                set_calls(eng, on)
                ms, ids = ms_per_token(eng, args.tokens)
                runs[on].append(round(ms, 2))
                tokens.setdefault(on, ids)
    finally:
        set_calls(eng, True)
        eng.close()
    on, off = statistics.median(runs[True]), statistics.median(runs[False])
    same = tokens[True] == tokens[False]
    print(f"\n| shape | layers | calls on (ms/token) | off | off / on | same tokens |\n|---|---|---|---|---|---|\n"
          f"| {args.shape} | {cfg.num_layers} | {on:.2f} {runs[True]} | {off:.2f} {runs[False]} | {off / on:.2f}x | "
          f"{same} |")
    path = write_report(args.out, f"cpu_calls_ab_{args.shape}",
                        {"shape": args.shape, "layers": cfg.num_layers, "dtype": "bfloat16", "tokens": args.tokens,
                         "cpu_matmul": kernels.status(), "on_ms": runs[True], "off_ms": runs[False],
                         "on_median_ms": on, "off_median_ms": off, "same_tokens": same},
                        "python -m engine.bench.cpu_calls_ab " + " ".join(sys.argv[1:] if argv is None else argv))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
