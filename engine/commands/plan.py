"""`python -m engine plan`: the per-tier plans for a model and a VRAM budget, as a table or JSON.

The model is a named shape (`engine.bench.shapes`, e.g. llama3-8b) or a model file/folder (its config
only is read). Prices come from the profile of `--device` ("sim" by default: the synthetic, reproducible
profile; "cuda" measures this machine on first use). `--json` prints the plan_report dict.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.errors import BadInputError
from engine.sharding.plan import DEFAULT_TIERS, PLAN_KINDS, Plan, PlanSet
from engine.units import format_bytes, parse_bytes

LETTER = {"resident": "R", "streamed": "S", "cpu": "C"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a named shape (llama3-8b, qwen3-8b, qwen2.5-7b, "
                   "smollm2-135m, qwen3-30b-a3b) or a path to a model file or folder")
    p.add_argument("--budget", required=True, help="VRAM budget, e.g. 4GiB, 512MB or a number of bytes")
    p.add_argument("--tiers", default=",".join(map(str, DEFAULT_TIERS)),
                   help="token tiers, comma separated (default %(default)s)")
    p.add_argument("--kv-tokens", type=int, default=4096, help="KV cache capacity in tokens (default 4096)")
    p.add_argument("--device", default="sim", help="sim (default), cuda, cuda:N or cpu")
    p.add_argument("--kind", default="auto", choices=("auto",) + PLAN_KINDS, help="force one plan kind")
    p.add_argument("--n-slots", type=int, default=2, help="streaming slots (default 2)")
    p.add_argument("--json", action="store_true", help="print the plan report as JSON")
    p.add_argument("--profile-file", default=None,
                   help="plan with the (first) profile stored in this database file instead of measuring "
                        "--device: a GPU machine's plans, here")


def load_config(model: str):
    from engine.bench.shapes import SHAPES, get_shape

    if model.lower() in SHAPES:
        return model.lower(), get_shape(model)
    from pathlib import Path

    if not Path(model).exists():
        raise BadInputError(f"--model {model!r}: neither a known shape ({', '.join(sorted(SHAPES))}) "
                            "nor an existing file or folder")
    try:
        from engine.loading import read_config
    except ImportError as exc:
        raise BadInputError(f"--model {model!r}: reading model files is unavailable here ({exc})") from exc
    return Path(model).name, read_config(model)


def parse_tiers(text: str) -> tuple[int, ...]:
    try:
        tiers = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise BadInputError(f"--tiers {text!r}: expected positive integers separated by commas") from None
    if not tiers or tiers[0] < 1:
        raise BadInputError(f"--tiers {text!r}: expected positive integers separated by commas")
    return tiers


def placement_map(plan: Plan) -> str:
    """'E:C | RC RS ... | H:R': embedding, then attention+FFN letters per layer, then the head. A MoE
    layer shows attention, router, ':' and its expert groups ('RR:SCCC'). K: attention streamed to the GPU
    over its layer's KV cache kept in host memory."""
    pl = {k: str(v) for k, v in plan.placement.items()}
    n_layers = sum(1 for k in pl if k.endswith(".attn"))
    experts: dict[int, str] = {}
    for k, v in pl.items():
        if ".experts." in k:
            layer = int(k.split(".")[1])
            experts[layer] = experts.get(layer, ":") + LETTER[v]
    attn = ["K" if plan.host_kv_attention(i) else LETTER[pl[f"layers.{i}.attn"]] for i in range(n_layers)]
    layers = " ".join(attn[i] + LETTER[pl[f"layers.{i}.ffn"]] + experts.get(i, "") for i in range(n_layers))
    return f"E:{LETTER[pl['embed']]} | {layers} | H:{LETTER[pl['head']]}"


def print_table(name: str, cfg, spec, planset: PlanSet, prof, kv_tokens: int, out=None) -> None:
    out = out or sys.stdout
    print(f"{name}: {cfg.arch}, {cfg.dtype}, {cfg.num_layers} layers, {format_bytes(spec.total_weight_bytes)}"
          f" of weights; budget {format_bytes(planset.budget)}; KV for {kv_tokens} tokens; "
          f"profile {prof.device}", file=out)
    head = f"{'tier':>5}  {'plan':<9}{'ms/step':>10}{'tokens/s':>10}  " + "".join(
        f"{h:>11}" for h in ("weights", "KV", "slots", "scratch", "total"))
    print(head, file=out)
    for p in planset.plans:
        v = p.vram
        tps = p.tier / p.predicted_ms * 1e3 if p.predicted_ms > 0 else float("inf")
        print(f"{p.tier:>5}  {p.kind:<9}{p.predicted_ms:>10.1f}{tps:>10.1f}  " + "".join(
            f"{format_bytes(x):>11}" for x in (v.weights, v.kv, v.slots, v.scratch, v.total)), file=out)
    print(f"longer inputs run fastest in steps of {planset.step_tokens} tokens", file=out)
    moe = " (MoE: attention, router:expert groups)" if cfg.is_moe else ""
    print(f"placement (E embedding | attention+FFN per layer{moe} | H head; R resident, S streamed, C cpu, "
          "K streamed over its KV in host memory):", file=out)
    for p in planset.plans:
        print(f"{p.tier:>5}  {placement_map(p)}", file=out)
    shared = [p for p in planset.plans if p.ffn_cpu_rows]
    if shared:
        inter = cfg.intermediate_size
        print("streamed FFNs with a CPU share (the last rows of gate and up computed on the CPU, the rest copied):",
              file=out)
        for p in shared:
            print(f"  tier {p.tier}: {p.ffn_cpu_rows} of {inter} rows ({p.ffn_cpu_rows / inter:.0%})", file=out)


def profile_from_file(path: str):
    """The first profile of a profile database file (one-line error when it is missing or not one)."""
    from engine.sharding.profile import ProfileDatabase

    try:
        data = json.loads(Path(path).read_text())
        entry = next(iter(data["profiles"].values()))
        return ProfileDatabase.from_dict(entry)
    except (OSError, ValueError, KeyError, StopIteration, TypeError) as exc:
        raise BadInputError(f"--profile-file {path}: not a readable profile database ({type(exc).__name__})") from exc


def run(args: argparse.Namespace) -> int:
    from engine.sharding.planner import Planner
    from engine.sharding.profile import ProfileDatabase
    from engine.sharding.spec import ModelSpec

    name, cfg = load_config(args.model)
    budget = parse_bytes(args.budget, "--budget")
    tiers = parse_tiers(args.tiers)
    if args.kv_tokens < 0:
        raise BadInputError(f"--kv-tokens {args.kv_tokens}: must not be negative")
    spec = ModelSpec.from_config(cfg)

    from engine.commands.profile import progress_printer

    if args.profile_file:
        prof = profile_from_file(args.profile_file)
    else:
        prof = ProfileDatabase.for_device(args.device, quick=True, progress=progress_printer(sys.stderr))
    planner = Planner(spec, prof, tiers=tiers, n_slots=args.n_slots)
    forced = None if args.kind == "auto" else args.kind
    planset = planner.plan(budget, kv_tokens=args.kv_tokens, force_kind=forced)
    if args.json:
        rep = planset.report()
        rep.update(model=name, device=args.device, profile=prof.device, kv_tokens=args.kv_tokens,
                   model_bytes=spec.total_weight_bytes, forced=args.kind)
        print(json.dumps(rep, indent=1))
    else:
        print_table(name, cfg, spec, planset, prof, args.kv_tokens)
    return 0
