"""The vision-language scenario of `python -m engine bench --gpu` (`--part vl`): the Qwen2.5-VL-7B shape
with one 2560x1440 image and a short question, per budget, Slipstream against transformers + accelerate.

Each system runs in a subprocess of its own (`engine.bench.vlm_bench`: the same random weights from the
same seeds, the same prompt ids and pixels), so their peaks do not mix and a hung run is stopped at its
time limit. A row records the time to first token (image preprocessing, the vision pass and the prefill of
the whole prompt, about 4,700 tokens of which 4,600 are the image's), decode tokens/s over the new tokens,
the peak NVML bytes of the whole process and whether it fit: Slipstream counts its whole process in its
budget, so it fits at a peak of at most the budget; accelerate at most the budget plus the allowance (a bare
PyTorch process with cuBLAS), as the other rows of the suite. accelerate decodes at under 1 token/s with
most of the model in host memory, so it generates fewer tokens (`ACCELERATE_NEW_TOKENS`).

llama.cpp has no row: its vision path (the multimodal projector GGUF and `llama-mtmd-cli`) is not built by
the suite.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

MODEL = "qwen2.5-vl-7b"
SCENARIO = "vl-1440p"
DRY_MODEL = "tiny-vl"
SLIPSTREAM_NEW_TOKENS = 32
ACCELERATE_NEW_TOKENS = 8
# seconds a run may take (drawing 16 GB of random weights included); less where the call ends sooner
LIMITS = {"slipstream": 200.0, "accelerate": 190.0}
MIN_LEFT = 90.0        # a run is not started with less than this left before the deadline


def row_for(system: str, model: str, budget: str, budget_bytes: int, res: dict, allowance: int,
            new_tokens: int, command: str) -> dict:
    """The results row of one run's vlm_bench result."""
    peak = res.get("nvml_peak_bytes")
    room = budget_bytes + (allowance if system != "slipstream" else 0)
    row = {"system": system, "model": model, "budget": budget, "budget_bytes": budget_bytes,
           "scenario": SCENARIO, "peak_vram_bytes": peak, "allowance_bytes": allowance,
           "fits": None if peak is None else peak <= room, "ttft_s": res.get("ttft_s"),
           "decode_tps": res.get("decode_tps"), "new_tokens": res.get("new_tokens"),
           "new_tokens_asked": new_tokens, "prompt_tokens": res.get("prompt_tokens"),
           "image_tokens": res.get("image_tokens"), "wall_s": res.get("wall_s"), "command": command}
    if system == "slipstream":
        row.update(vision_where=res.get("vision_where"), vision_ms=res.get("vision_ms"),
                   accounting_peak_bytes=res.get("accounting_peak_bytes"), plan=res.get("plan"))
    else:
        row["plan"] = res.get("device_map")
    if res.get("error"):
        row["error"] = res["error"]
        row["log_tail"] = res.get("log_tail")
    return row


def run_vl(args, part, deadline, command: str, budgets: list[tuple[str, int]], allowance: int,
           systems: tuple[str, ...] = ("slipstream", "accelerate"), say=print) -> None:
    """Each (budget, system) not in `part` yet, while the deadline allows."""
    from engine.bench import vlm_bench
    from engine.bench.partials import row_key

    dry = bool(args.dry_run)
    shape, device, model = ("tiny", "sim", DRY_MODEL) if dry else ("7b", "cuda", MODEL)
    profile_db = os.environ.get("SLIPSTREAM_PROFILE_DB") or "docs/benchmarks/profiles/h200.json"
    with tempfile.TemporaryDirectory(prefix="vl-part-") as tmp:
        config_dir = str(vlm_bench.write_config(shape, Path(tmp) / f"qwen2_5_vl-{shape}"))
        for budget, budget_bytes in budgets:
            for system in systems:
                if part.has(row_key({"system": system, "model": model, "budget": budget, "scenario": SCENARIO})):
                    say(f"vl {system} {budget}: done in an earlier call")
                    continue
                if not deadline.allows(MIN_LEFT):
                    say("deadline reached: the rest is left for a later call")
                    return
                new_tokens = SLIPSTREAM_NEW_TOKENS if system == "slipstream" else ACCELERATE_NEW_TOKENS
                ns = SimpleNamespace(device=device, shape=shape, budget=budget_bytes, new_tokens=new_tokens,
                                     config_dir=config_dir, profile_db=profile_db)
                limit = deadline.cap(LIMITS[system])
                res = vlm_bench.spawn(system, ns, limit)
                row = row_for(system, model, budget, budget_bytes, res, allowance, new_tokens, command)
                if row.get("error") and limit < LIMITS[system]:
                    row["pending"] = True          # cut short by the call's end: a later call runs it again
                part.add(row)
                (part.log_dir / f"{system}-{budget}.txt").write_text("\n".join(res.get("log_tail") or []) + "\n")
                say(f"  vl {system} {budget}: TTFT {row['ttft_s']} s, decode {row['decode_tps']} t/s, peak NVML "
                    f"{(row['peak_vram_bytes'] or 0) / 2**30:.2f} GiB, fits {row['fits']}"
                    + (f"; error {row['error']}" if row.get("error") else ""))
