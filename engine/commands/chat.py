"""`python -m engine chat`: a terminal chat; answers stream as they are generated.

Commands inside the chat: /reset (new conversation), /budget SIZE (re-plan live), /plan, /quit.
Ctrl-C stops the answer being written; a second Ctrl-C at the prompt quits.
"""

from __future__ import annotations

import argparse
import sys

from engine.commands.common import (
    add_model_arguments,
    add_sampling_arguments,
    open_from_args,
    sampling_kwargs,
)
from engine.errors import SlipstreamError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", default=None, help="a system prompt")
    add_model_arguments(p)
    add_sampling_arguments(p)


def run(args) -> int:
    eng = open_from_args(args)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    print(f"Slipstream chat — {eng.source} ({eng.backend}). /reset, /budget 4GiB, /plan, /quit", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            break
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/reset":
            messages = list(base)
            continue
        if line.startswith("/budget"):
            try:
                eng.set_vram_budget(line.split(None, 1)[1])
                print(_plan_line(eng), file=sys.stderr)
            except (IndexError, SlipstreamError) as exc:
                print(f"error: {exc}", file=sys.stderr)
            continue
        if line == "/plan":
            print(_plan_line(eng), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        answer = []
        try:
            for ev in eng.generate(messages, **sampling_kwargs(args)):
                answer.append(ev.text)
                sys.stdout.write(ev.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            eng.cancel()
        except SlipstreamError as exc:
            print(f"\nerror: {exc}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(answer)})
    eng.close()
    return 0


def _plan_line(eng) -> str:
    rep = eng.plan_report()
    tiers = ", ".join(f"{t['tokens']}:{t['plan']}" for t in rep["tiers"])
    return f"budget {rep['budget'] / 2**30:.2f} GiB; plans per tier {tiers}"
