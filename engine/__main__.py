"""`python -m engine <command>`: the engine's command line.

Each command lives in `engine/commands/<name>.py` with `add_arguments(parser)` and `run(args) -> int`.
A `SlipstreamError` becomes one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": "generate text from a prompt, streamed to the terminal",
    "chat": "chat with a model in the terminal",
    "plan": "print the per-tier plans for a model and a VRAM budget",
    "profile": "measure this machine and write the profile database",
    "bench": "run the benchmark suite",
    "serve": "serve the OpenAI-compatible API on 127.0.0.1",
    "worker": "run as the app's engine worker process (protocol on stdin/stdout)",
}


def main(argv: list[str] | None = None) -> int:
    from engine.errors import SlipstreamError

    parser = argparse.ArgumentParser(prog="python -m engine", description="Slipstream inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in COMMANDS.items():
        try:
            mod = importlib.import_module(f"engine.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"engine.commands.{name}":
                raise
            continue
        modules[name] = mod
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return int(modules[args.command].run(args) or 0)
    except SlipstreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
