"""`python -m engine generate --prompt TEXT`: one completion, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from engine.commands.common import (
    add_model_arguments,
    add_sampling_arguments,
    open_from_args,
    sampling_kwargs,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--stats", action="store_true", help="print time to first token and tokens/s at the end")
    add_model_arguments(p)
    add_sampling_arguments(p)


def run(args) -> int:
    eng = open_from_args(args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    finish = None
    for ev in eng.generate(prompt, **sampling_kwargs(args)):
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        finish = ev.finish_reason or finish
    sys.stdout.write("\n")
    if args.stats:
        s = eng.stats()
        print(f"[{finish}; ttft {s['ttft_s'] or 0:.3f} s; prefill {s['prefill_tokens_per_s'] or 0:.1f} tok/s; "
              f"decode {s['decode_tokens_per_s'] or 0:.1f} tok/s; backend {eng.backend}]", file=sys.stderr)
    eng.close()
    return 0
