"""What the FP8 KV cache does to a real model's output: teacher-forced next-token distributions over a
paragraph with the model's own cache precision and with FP8 keys/values, compared position by position.

    python -m engine.bench.fp8_kv_effect [--model PATH] [--out docs/benchmarks]

Default model: the bundled SmolLM2-135M-Instruct (its Q4_1 weights dequantized to float32, so the
reference cache is float32).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from engine.bench.gpu_common import write_report

TEXT = ("The river town woke slowly. Fishermen checked their nets at the harbour while the bakery on the corner "
        "pulled the first loaves from its ovens, and the smell of bread drifted over the cobbled square. By "
        "eight the market stalls were up: apples and pears from the valley farms, cheese wrapped in cloth, "
        "bundles of herbs, and a table of second-hand books that the schoolteacher visited every Saturday. "
        "Children ran between the stalls, the church bell rang the hour, and an old dog slept in the sun "
        "beside the fountain, unbothered by the carts rolling past on their way to the bridge.")


def main(argv=None) -> int:
    import engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    logits = {}
    for kv in (None, "fp8"):
        eng = engine.open_model(args.model, device="cpu", backend="torch", kv_dtype=kv)
        ids = eng.encode_prompt(TEXT)
        logits[kv] = eng.score(ids)
        source = eng.source
        eng.close()
    ref, fp8 = logits[None], logits["fp8"]
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    row = {"model": Path(source).name, "tokens": len(ids),
           "top1_agreement": (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
           "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
           "max_abs_logit_diff": (fp8 - ref).abs().max().item(),
           "kv_bytes_per_token_ratio": None}
    from engine.loading import read_config
    from engine.sharding.spec import ModelSpec

    cfg = read_config(args.model)
    per = {kv: next(s.kv_bytes_per_token for s in ModelSpec.from_config(cfg, kv_dtype=kv).sublayers
                    if s.kind == "attn") for kv in (None, "fp8")}
    row["kv_bytes_per_token_ratio"] = per["fp8"] / per[None]
    path = write_report(Path(args.out), "fp8_kv", {"rows": [row]},
                        " ".join(["python -m engine.bench.fp8_kv_effect"] + (argv or sys.argv[1:])))
    print("| model | tokens | top-1 agreement | mean KL | max KL | KV bytes/token vs model precision |")
    print("|---|---|---|---|---|---|")
    print(f"| {row['model']} | {row['tokens']} | {row['top1_agreement']:.3f} | {row['mean_kl']:.4f} | "
          f"{row['max_kl']:.3f} | {row['kv_bytes_per_token_ratio']:.3f} |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
