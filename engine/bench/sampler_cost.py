"""Host milliseconds per sampled token: the engine's sampler against softmax + torch.multinomial and against
a full sort for top-p, over real vocabulary sizes, with flat and peaked logits.

    python -m engine.bench.sampler_cost --out docs/benchmarks

A decode step samples once per token on the host; over a 150k vocabulary torch.multinomial took 4-5 ms and
a top-p sort 17-20 ms per token on the H200 host (session 8), several percent of a decode step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report
from engine.generation import Sampler, SamplingParams

VOCABS = (49152, 128256, 151936)     # SmolLM2, Llama 3, Qwen 2.5/3
SCALES = (1.0, 4.0)                  # logits' spread: near-flat (random weights), peaked


def _ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def _sorted_top_p(logits: torch.Tensor, top_p: float, g: torch.Generator) -> int:
    """The textbook way: softmax, full sort, cumulative sum, multinomial."""
    probs = torch.softmax(logits.float(), -1)
    sp, idx = torch.sort(probs, descending=True)
    keep = torch.cumsum(sp, 0) - sp < top_p
    return int(idx[keep][torch.multinomial(sp[keep], 1, generator=g)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    rows = []
    print("| vocab | logits | top_p | engine ms | softmax + multinomial ms | softmax + sort + multinomial ms |")
    print("|---|---|---|---|---|---|")
    for vocab in VOCABS:
        for scale in SCALES:
            logits = (torch.randn(vocab, generator=g) * scale).to(torch.bfloat16)
            for top_p in (1.0, 0.95):
                s = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=1))
                engine_ms = _ms(lambda s=s, lg=logits: s(lg), args.reps)
                plain_ms = _ms(lambda lg=logits: torch.multinomial(torch.softmax(lg.float(), -1), 1, generator=g),
                               args.reps)
                sort_ms = (_ms(lambda lg=logits, p=top_p: _sorted_top_p(lg, p, g), max(args.reps // 3, 3))
                           if top_p < 1 else None)
                rows.append({"vocab": vocab, "logit_scale": scale, "top_p": top_p, "engine_ms": engine_ms,
                             "multinomial_ms": plain_ms, "sort_multinomial_ms": sort_ms})
                print(f"| {vocab} | x{scale:g} | {top_p} | {engine_ms:.2f} | {plain_ms:.2f} | "
                      + ("-" if sort_ms is None else f"{sort_ms:.2f}") + " |")
    path = write_report(args.out, "sampler_cost", {"threads": torch.get_num_threads(), "rows": rows},
                        "python -m engine.bench.sampler_cost " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
