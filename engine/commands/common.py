"""Options shared by the commands that open a model."""

from __future__ import annotations

import argparse


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: the bundled model)")
    p.add_argument("--device", default="auto", help="auto | cpu | sim | cuda | cuda:N")
    p.add_argument("--budget", default=None, help="VRAM budget, e.g. 4GiB (default: what is free)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "llamacpp"])
    p.add_argument("--plan", default="auto", choices=["auto", "gpu_only", "static", "dynamic"],
                   help="force a plan kind (torch backend)")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)


def open_from_args(args):
    import engine

    eng = engine.open_model(args.model, device=args.device, vram_budget=args.budget, backend=args.backend)
    if args.plan != "auto":
        eng.force_plan(args.plan)
    return eng


def sampling_kwargs(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "top_k": args.top_k, "stop": args.stop, "seed": args.seed}
