"""llama.cpp baseline configurations, their VRAM model, the largest-that-fits search and output parsing.

Pure functions (no processes, no GPU), so the harness logic is tested on any machine.

A configuration is a `Variant` (fixed flags) and an integer `x` that moves weights onto the GPU:
- mode "ngl": `-ngl x` (x = 0 .. layers + 1; layers + 1 also offloads the output layer).
- mode "attn": attention on the GPU, FFNs (MoE: experts) on the CPU. x <= layers + 1: `-ngl x` with every
  FFN on the CPU (`-ot "ffn_.*=CPU"`; MoE `--n-cpu-moe layers`); x > layers + 1: `-ngl 99` and the FFNs
  of x - layers - 1 layers on the GPU too (dense: the first ones, by `-ot`; MoE: `--n-cpu-moe` keeps the
  first layers' experts on the CPU, so the last ones move; the same bytes). VRAM grows with x in both modes.

Fitting rule: a run fits budget B when its process's peak NVML bytes <= B + the allowance (the NVML
bytes of the same program holding nothing: its CUDA context). The search predicts the peak as
C + offloaded_bytes(x), learns C from each run (C = peak - offloaded bytes), and re-runs at most twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.bench.gguf_shapes import GgufShape


@dataclass(frozen=True)
class Variant:
    name: str
    system: str                  # "llama.cpp-default" | "llama.cpp-tuned"
    flags: tuple[str, ...]       # besides -m, -ngl, -p, -n, -t, -r, -o
    mode: str = "ngl"            # "ngl" | "attn"
    prior_c: float = 1.7e9       # predicted peak - offloaded bytes before any run (bytes)
    default_on: bool = True      # run unless --tuned names the variants

    @property
    def key(self) -> str:
        return f"{self.system}/{self.name}"


NO_MMAP = ("-lm", "none")
BIG_BATCH = ("-ub", "2048", "-b", "4096")
DEFAULT = Variant("default", "llama.cpp-default", ())
TUNED = (
    Variant("nommap+ub2048+attn-gpu", "llama.cpp-tuned", NO_MMAP + BIG_BATCH, "attn", 3.2e9),
    Variant("nommap+ub2048", "llama.cpp-tuned", NO_MMAP + BIG_BATCH, "ngl", 3.2e9),
    Variant("nommap+attn-gpu", "llama.cpp-tuned", NO_MMAP, "attn", 1.7e9),
    Variant("nommap", "llama.cpp-tuned", NO_MMAP, "ngl", 1.7e9, default_on=False),   # ~ the default
    # attention on the GPU with llama.cpp's default loading (mmap): loads in seconds where -lm none copies
    # the whole file into pinned memory first (the 31 GB MoE shape: tens of seconds per run)
    Variant("attn-gpu", "llama.cpp-tuned", (), "attn", 1.7e9, default_on=False),
)


def c_prior(variant: Variant, learned: dict, model: str, variants=()) -> float:
    """The C a search starts from: the one learned for this variant (an earlier budget or call), else one
    learned for a variant that differs only in how weights load (`-lm none` or not: the same VRAM),
    else the variant's guess."""
    own = learned.get(f"{model}|{variant.key}")
    if own is not None:
        return own
    twin = [f for f in variant.flags if f not in NO_MMAP]
    for other in variants:
        if other.mode == variant.mode and [f for f in other.flags if f not in NO_MMAP] == twin:
            c = learned.get(f"{model}|{other.key}")
            if c is not None:
                return c
    return variant.prior_c


def x_max(shape: GgufShape, mode: str) -> int:
    return shape.layers + 1 if mode == "ngl" else 2 * shape.layers + 1


def kv_bytes_per_layer(shape: GgufShape, n_ctx: int) -> int:
    return 2 * shape.kv_heads * shape.head_dim * 2 * n_ctx        # K and V, f16


def offloaded_bytes(shape: GgufShape, mode: str, x: int, n_ctx: int = 4096) -> int:
    """Weight and KV bytes that configuration x puts on the GPU."""
    wb = shape.weight_bytes()
    kv = kv_bytes_per_layer(shape, n_ctx)
    n = shape.layers
    if mode == "ngl":
        layers = min(x, n)
        return layers * (wb["layer"] + kv) + (wb["output"] if x > n else 0)
    attn_layers = min(x, n)
    total = attn_layers * (wb["layer_attn"] + kv) + (wb["output"] if x > n else 0)
    return total + max(0, x - n - 1) * wb["layer_ffn"]


def _range(lo: int, hi: int) -> str:
    return "|".join(str(i) for i in range(lo, hi))


def variant_args(shape: GgufShape, variant: Variant, x: int) -> list[str]:
    """The flags of configuration x of `variant` (the fixed flags first)."""
    args = list(variant.flags)
    n = shape.layers
    if variant.mode == "ngl":
        return args + ["-ngl", str(x)]
    if x <= n + 1:
        args += ["-ngl", str(x)]
        if shape.is_moe:
            return args + ["--n-cpu-moe", str(n)]
        return args + ["-ot", "ffn_.*=CPU"]
    on_gpu = x - n - 1                   # FFNs of layers 0 .. on_gpu-1 on the GPU
    args += ["-ngl", "99"]
    if shape.is_moe:                     # --n-cpu-moe N keeps the experts of layers 0 .. N-1 on the CPU:
        return args + ["--n-cpu-moe", str(n - on_gpu)]   # those of the last on_gpu layers go to the GPU
    if on_gpu >= n:
        return args
    return args + ["-ot", rf"blk\.({_range(on_gpu, n)})\.ffn_.*=CPU"]


def largest_fitting(shape: GgufShape, mode: str, c: float, limit: float, n_ctx: int = 4096) -> int:
    """The largest x whose predicted peak C + offloaded bytes is within `limit`; -1 if none."""
    best = -1
    for x in range(x_max(shape, mode) + 1):
        if c + offloaded_bytes(shape, mode, x, n_ctx) <= limit:
            best = x
    return best


@dataclass
class SearchResult:
    x: int | None                                   # the largest fitting x that ran; None if none fit
    runs: dict[int, dict] = field(default_factory=dict)   # x -> {"peak": bytes, ...the run's record}
    learned_c: float | None = None
    note: str = ""
    aborted: bool = False                           # a run was cut short (time limit): try again later

    @property
    def best(self) -> dict | None:
        return self.runs.get(self.x) if self.x is not None else None


def search_fit(shape: GgufShape, mode: str, limit: float, measure: Callable[[int], dict],
               c_prior: float, max_runs: int = 3, n_ctx: int = 4096) -> SearchResult:
    """Run `measure(x)` (returns a record with "peak" bytes, or "error") at the predicted largest
    fitting x, learn C from it, and move up or down until the prediction agrees with what ran."""
    res = SearchResult(None)
    c = c_prior
    x = largest_fitting(shape, mode, c, limit, n_ctx)
    x = max(x, 0)                                        # measure the smallest: the prior may be wrong
    fitting: list[int] = []
    for _ in range(max_runs):
        rec = measure(x)
        res.runs[x] = rec
        if rec.get("abort"):
            res.aborted = True
            res.runs.pop(x)
            break
        if rec.get("error") and not rec.get("peak"):
            res.note = f"x={x}: {rec['error']}"
            break
        peak = rec["peak"]
        c = peak - offloaded_bytes(shape, mode, x, n_ctx)
        res.learned_c = c
        if peak <= limit and not rec.get("error"):
            fitting.append(x)
            nxt = largest_fitting(shape, mode, c, limit, n_ctx)
            if nxt <= x or nxt in res.runs:
                break
        else:
            nxt = min(largest_fitting(shape, mode, c, limit, n_ctx), x - 1)
            if nxt < 0 or nxt in res.runs:
                break
        x = nxt
    res.x = max(fitting) if fitting else None
    if res.x is None and not res.note:
        res.note = "no configuration of this variant fits the budget"
    return res


# ---- output parsing ----------------------------------------------------------------------------------
def _objects(text: str) -> list[dict]:
    """JSON objects from llama-bench's `-o jsonl` or `-o json` output (complete ones only)."""
    text = text.strip()
    if text.startswith("["):
        try:
            return [o for o in json.loads(text) if isinstance(o, dict)]
        except json.JSONDecodeError:
            text = text[1:]                          # a run cut short: fall back to line by line
    out = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def parse_llama_bench(text: str) -> dict:
    """{"pp512": t/s, "pp4096": t/s, "tg32": t/s, ...} plus "records" (the raw objects)."""
    res: dict = {"records": []}
    for o in _objects(text):
        if "avg_ts" not in o:
            continue
        n_p, n_g = int(o.get("n_prompt", 0)), int(o.get("n_gen", 0))
        key = f"pp{n_p}" if n_p and not n_g else f"tg{n_g}" if n_g and not n_p else f"pp{n_p}+tg{n_g}"
        res[key] = float(o["avg_ts"])
        res["records"].append({k: o.get(k) for k in ("n_prompt", "n_gen", "n_gpu_layers", "n_batch", "n_ubatch",
                                                     "n_threads", "avg_ts", "stddev_ts", "samples_ts",
                                                     "model_size", "build_commit", "flash_attn", "load_mode")
                               if k in o})
    return res


def parse_batched_bench(text: str) -> dict:
    """{"tg_b4": t/s, "tg_b16": t/s, "pp_b4": ..., "records": [...]} from `--output-format jsonl`."""
    res: dict = {"records": []}
    for o in _objects(text):
        if "speed_tg" not in o:
            continue
        pl = int(o["pl"])
        res[f"tg_b{pl}"] = float(o["speed_tg"])
        res[f"pp_b{pl}"] = float(o["speed_pp"])
        res["records"].append(o)
    return res
