"""`python -m engine bench --gpu`: Slipstream against llama.cpp, accelerate and the physical bound (issue 6).

The work is split in parts that fit the device tool's 10-minute calls (`--part`, comma-separated; with
several, each runs in its own process, in order):
  build-llamacpp  build llama-bench + llama-batched-bench (CUDA, sm_90) from carry/llama.cpp-src.tar.xz,
                  or reuse a build in /tmp or carried packed parts; `--pack-bins` writes the parts to --out
  gguf            write the random-weight GGUFs into the work folder (can run beside the build)
  llamacpp        llama.cpp-default and llama.cpp-tuned rows (writes the GGUF first if needed)
  slipstream      Slipstream rows (random weights on the GPU), with the plan it chose
  accelerate      transformers + accelerate device_map offload rows
  corun           the game stand-in beside Slipstream (auto mode) and beside llama.cpp (fixed -ngl)
  vl              the Qwen2.5-VL-7B shape with a 2560x1440 image: Slipstream and accelerate per budget
                  (time to first token, decode, peak; engine.bench.vl_runs)
  merge           part-*.json (from --out and --prior) -> results.json, results.md, PNG plots (+ bound rows)
Each part (but build-llamacpp and gguf) writes `part-<name>.json` after every row and packs its raw logs to `<name>-logs.tar.xz` in
--out; rows already in `--prior` files are not run again. `SLIPSTREAM_BENCH_DEADLINE` (epoch seconds) or
`--deadline-epoch` tells the parts when the device call ends: they stop starting work that would not
finish. `--dry-run` runs tiny shapes on the CPU ("sim" device, a simulated card), skipping what needs a GPU.
See docs/benchmarks/HOWTO_GPU.md for the device calls.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

PARTS = ("build-llamacpp", "gguf", "llamacpp", "slipstream", "accelerate", "corun", "vl", "merge")
ENGINE_PARTS = ("slipstream",)    # parts that open an engine per shape: one process per shape
                                   # (accelerate runs the dense shape only unless --models says more)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("--gpu suite")
    g.add_argument("--part", default=None, help=f"comma-separated, in order: {', '.join(PARTS)}")
    g.add_argument("--prior", default=None, help="folder of part-*.json from earlier calls (resume; merge input)")
    g.add_argument("--models", default=None, help="scenarios, comma-separated (default: llama3-8b,qwen3-30b-a3b)")
    g.add_argument("--budgets", default=None, help="comma-separated (default: 2GiB,4GiB,8GiB)")
    g.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, simulated card")
    g.add_argument("--deadline-epoch", type=float, default=None, help="when this device call ends (epoch s)")
    g.add_argument("--carry", default="carry", help="folder with llama.cpp-src.tar.xz and the gguf wheel")
    g.add_argument("--llamacpp-bin", default=None, help="an existing folder with llama-bench (skips the build)")
    g.add_argument("--pack-bins", action="store_true", help="build-llamacpp: write packed binaries to --out")
    g.add_argument("--tuned", default=None,
                   help="llama.cpp tuned variants, comma-separated (default: those of llamacpp_plan.TUNED "
                        "marked default_on: nommap+ub2048+attn-gpu, nommap+ub2048, nommap+attn-gpu)")
    g.add_argument("--no-batched", action="store_true", help="skip llama-batched-bench")
    g.add_argument("--llamacpp-prompts", default=None,
                   help="llama-bench prompt lengths, comma-separated (default: the scenario's: 512,4096; the "
                        "MoE shape 512, since each of its runs reloads 31 GB)")
    g.add_argument("--llamacpp-reps", type=int, default=1,
                   help="llama-bench -r: runs averaged per figure (default 1: every run reloads the model, so the "
                        "suite runs one; a pair measured on one lease with Slipstream's five runs wants more)")
    g.add_argument("--plan-only", action="store_true",
                   help="with --part llamacpp: print the llama-bench runs it would start and the simulated "
                        "search per budget; runs nothing")
    g.add_argument("--gguf-dtype", default="f16", choices=("f16", "bf16"))
    g.add_argument("--corun-systems", default="slipstream,slipstream+overhead,llama.cpp",
                   help="slipstream: the app's wiring (monitor budget -> set_vram_budget); slipstream+overhead: "
                        "the budget less the engine's measured non-budget VRAM (CUDA context, cache); llama.cpp")
    g.add_argument("--cap", default="24GiB", help="co-run: the card's size")
    g.add_argument("--vl-systems", default=None, help="vl: systems, comma-separated (default: slipstream,accelerate)")
    g.add_argument("--phases", default="6GiB:20,16GiB:25,6GiB:20", help="co-run: game working set:seconds")
    g.add_argument("--results-dir", default=None, help="merge: where results.json/.md/PNGs go (default --out)")


def machine_info() -> dict:
    """CPU, GPU (through NVML, so this process never opens a CUDA context), versions."""
    info: dict = {"host": platform.node(), "cpu_threads": os.cpu_count(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        info["cpu"] = platform.machine()
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        info["gpu"] = name.decode() if isinstance(name, bytes) else name
        info["gpu_memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        drv = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = drv.decode() if isinstance(drv, bytes) else drv
        info["pcie"] = f"gen {pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)} x{pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)}"
    except Exception as exc:  # noqa: BLE001 - a CPU-only machine
        info["gpu"] = f"none ({type(exc).__name__})"
    return info


def command_line() -> str:
    """The command that runs this part again (as `python -m engine bench --gpu ...`)."""
    args = [a for a in sys.argv[1:] if a not in ("bench", "--gpu")]
    return "python -m engine bench --gpu " + " ".join(shlex.quote(a) for a in args)


def _use_gguf_wheel(carry: Path) -> None:
    """Import `gguf` from the carried wheel where it is not installed (a pure-Python zip imports as is)."""
    try:
        import gguf  # noqa: F401
        return
    except ImportError:
        pass
    for whl in sorted(carry.glob("gguf-*.whl")):
        sys.path.insert(0, str(whl))
        return


def run(args: argparse.Namespace) -> int:
    parts = [p for p in (args.part or "").split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if not parts or bad:
        print(f"--part: expected one or more of {', '.join(PARTS)} (got {args.part!r})", file=sys.stderr)
        return 2
    if args.plan_only:
        if parts != ["llamacpp"]:
            print("--plan-only: only with --part llamacpp", file=sys.stderr)
            return 2
        from engine.bench import gpu_parts

        return gpu_parts.plan_llamacpp(args)
    if args.deadline_epoch:
        os.environ["SLIPSTREAM_BENCH_DEADLINE"] = str(args.deadline_epoch)
    if len(parts) > 1:                        # each part in its own process: no CUDA context carries over
        return run_children([(f"part {p}", child_argv(sys.argv[1:], p)) for p in parts])
    from engine.bench.scenarios import pick

    models = [sc.model for sc in pick(args.models, args.dry_run)] if parts[0] in ENGINE_PARTS else []
    if len(models) > 1:
        # One shape per process as well: a second engine in one process met an out-of-memory at 2 GiB
        # (session 7), its budget then cut by a quarter for the rest of that row. The children share --out
        # and resume from each other's part file.
        return run_children([(f"part {parts[0]}, {m}", child_argv(sys.argv[1:], parts[0], m)) for m in models])
    from engine.bench import gpu_parts

    _use_gguf_wheel(Path(args.carry))
    t0 = time.perf_counter()
    rc = gpu_parts.run_part(parts[0], args, machine_info(), command_line())
    print(f"part {parts[0]}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rc


def run_children(children: list[tuple[str, list[str]]]) -> int:
    """Run `python -m engine.bench.gpu_suite ARGV` for each (title, ARGV) in turn; the first failing exit
    status, else 0."""
    code = 0
    for title, argv in children:
        print(f"=== {title} ===", flush=True)
        rc = subprocess.call([sys.executable, "-m", "engine.bench.gpu_suite", *argv])   # (every child runs)
        code = code or rc
    return code


def child_argv(argv: list[str], part: str, models: str | None = None) -> list[str]:
    """This command's arguments for one part (without `bench --gpu`, with `--part PART`, and with
    `--models MODELS` in place of its own where given)."""
    drop = ("--part", "--models") if models else ("--part",)
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("bench", "--gpu") or any(a.startswith(d + "=") for d in drop):
            continue
        if a in drop:
            skip = True
            continue
        out.append(a)
    return ["--part", part, *(["--models", models] if models else []), *out]


def main(argv: list[str] | None = None) -> int:
    """`python -m engine.bench.gpu_suite --part ...`: the same as `python -m engine bench --gpu --part ...`."""
    from engine.commands.bench import add_common_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
