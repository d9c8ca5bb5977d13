"""`python -m engine bench`: run one benchmark suite, picked by a flag.

Each suite is a module under `engine.bench` with `run(args) -> int`; it prints a markdown table and
writes its reports under `--out`. Add a suite by adding it to `SUITES` (its flag is `--<name>`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# flag name -> (module, help)
SUITES: dict[str, tuple[str, str]] = {
    "cpu-backends": ("engine.bench.cpu_backends",
                     ("torch vs llama.cpp backends on the default model on this CPU: prefill and decode "
                     "tokens/s (writes cpu_default_model.json/.md)")),
    "gpu": ("engine.bench.gpu_suite",
            ("issue 6 on the GPU machine: Slipstream vs llama.cpp (default, tuned), accelerate and the bound "
             "at 2/4/8 GiB, and a co-run beside a game stand-in; --part splits it across device calls "
             "(see docs/benchmarks/HOWTO_GPU.md)")),
}


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled model)")
    parser.add_argument("--runs", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    parser.add_argument("--backends", default=None, help="comma-separated backends (default: all)")
    parser.add_argument("--out", default="docs/benchmarks", help="folder for the JSON and markdown reports")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("suites (pick one)")
    for name, (_, help_text) in SUITES.items():
        group.add_argument(f"--{name}", dest="suite", action="store_const", const=name, help=help_text)
    add_common_arguments(parser)
    from engine.bench.gpu_suite import add_arguments as add_gpu_arguments  # imports nothing heavy

    add_gpu_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if getattr(args, "suite", None) is None:
        names = ", ".join(f"--{n}" for n in SUITES)
        print(f"pick a benchmark suite: {names} (see python -m engine bench --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[args.suite][0])
    return int(module.run(args) or 0)
