"""What the FP8 KV cache does to a real model's output: teacher-forced next-token distributions over a
paragraph with the model's own cache precision and with FP8 keys/values, compared position by position.

    python -m engine.bench.fp8_kv_effect [--model PATH] [--out docs/benchmarks]

Default model: the bundled SmolLM2-135M-Instruct (its Q4_1 weights dequantized to float32, so the
reference cache is float32). `--dtypes model,bfloat16` adds a row where the same weights are rounded to
bfloat16 for this measurement (said in the row): its reference cache is then a bf16 cache, the comparison
the FP8 option replaces on 16-bit models.
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

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtypes", default="model",
                    help="comma-separated: model (the precision given) and/or bfloat16 (weights rounded to "
                         "bf16 for this measurement, so the reference cache is bf16)")
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args(argv)
    rows = [_compare(args.model, dt) for dt in args.dtypes.split(",")]
    path = write_report(Path(args.out), "fp8_kv", {"rows": rows},
                        " ".join(["python -m engine.bench.fp8_kv_effect"] + (argv or sys.argv[1:])))
    print("| model | weights | reference cache | tokens | top-1 agreement | mean KL | max KL | KV bytes/token vs reference |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['model']} | {row['weights']} | {row['reference_cache']} | {row['tokens']} | "
              f"{row['top1_agreement']:.3f} | {row['mean_kl']:.4f} | {row['max_kl']:.3f} | "
              f"{row['kv_bytes_per_token_ratio']:.3f} |")
    print(f"wrote {path}")
    return 0


def _compare(model, dtype: str) -> dict:
    """Teacher-forced logits with the reference cache and with FP8 keys/values, compared."""
    import dataclasses

    from engine.backends.torch_engine import TorchEngine
    from engine.loading import load_model
    from engine.loading.bundled import bundled_model_path
    from engine.sharding.spec import ModelSpec

    if dtype not in ("model", "bfloat16"):
        raise SystemExit(f"--dtypes: {dtype!r} is not 'model' or 'bfloat16'")
    logits = {}
    for kv in (None, "fp8"):
        loaded = load_model(model if model else bundled_model_path())
        weights_note = f"{loaded.file_type} as loaded ({loaded.config.dtype})"
        if dtype == "bfloat16":
            loaded.weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in loaded.weights.items()}
            loaded.config = dataclasses.replace(loaded.config, dtype="bfloat16")
            weights_note = f"{loaded.file_type} rounded to bfloat16 for this measurement"
        eng = TorchEngine(loaded, device="cpu", kv_dtype=kv)
        ids = eng.encode_prompt(TEXT)
        logits[kv] = eng.score(ids)
        source, cfg = eng.source, eng.config
        eng.close()
    ref, fp8 = logits[None], logits["fp8"]
    kl = torch.nn.functional.kl_div(fp8.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    per = {kv: next(s.kv_bytes_per_token for s in ModelSpec.from_config(cfg, kv_dtype=kv).sublayers
                    if s.kind == "attn") for kv in (None, "fp8")}
    return {"model": Path(source).name, "weights": weights_note, "reference_cache": cfg.dtype, "tokens": len(ids),
            "top1_agreement": (fp8.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
            "max_abs_logit_diff": (fp8 - ref).abs().max().item(),
            "kv_bytes_per_token_ratio": per["fp8"] / per[None]}


if __name__ == "__main__":
    sys.exit(main())
