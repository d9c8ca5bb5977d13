"""Slipstream rows: prefill 512/4096 and decode tokens/s at each budget, peak NVML, the plan it chose.

One engine per scenario over random weights (drawn on the GPU), opened at the smallest budget; each
larger budget is applied with `set_vram_budget` (a live re-plan, as in use), budgets ascending, so the
NVML peak of a budget can only include leftovers of a smaller one. Per budget: a warm-up at each prompt
length, then `runs` prefills of each length (prefill tokens/s = prompt tokens / time to first token; each
prompt, at every length and budget, is drawn afresh, so no cached prefix is reused: each row records the
prefix-cache hits its measured prefills saw, which must be 0) and one decode of 32 tokens after
a 64-token prompt (tokens/s after the first). Batched decode: 4 and 16 requests submitted at once to the
continuous-batching scheduler, their tokens after every stream has its first one over the time to the
last (llama-batched-bench's decode figure counts the same way), and over the whole wall time. A scenario
the engine cannot open gets rows that say why.
"""

from __future__ import annotations

import os
import random
import statistics
import time
import traceback

from engine.bench.scenarios import BATCHES, DECODE_TOKENS, PROMPTS
from engine.bench.vram_poll import VramPoller

DECODE_PROMPT = 64
DECODE_RUNS = 5           # (session 15: the MoE 2 GiB row's three runs were 18.8, 18.5 and 25.9 t/s)
BATCH_NEW_TOKENS = 32       # per stream in the batched rows (llama-batched-bench's rows decode 32 too)


def open_engine(scenario, budget: int, device: str, n_ctx: int, **engine_kwargs):
    from engine.backends.torch_engine import TorchEngine
    from engine.loading.random_init import random_model

    cfg = scenario.engine_config()
    loaded = random_model(cfg, seed=0, name=scenario.model)
    engine_kwargs.setdefault("speculative", False)   # plain decoding, as the baselines run
    eng = TorchEngine(loaded, device=device, vram_budget=budget, n_ctx=n_ctx, **engine_kwargs)
    del loaded
    _empty_cache()
    return eng


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _prompt(n: int, run: int, salt: str = "") -> str:
    """`n` printable bytes (the byte tokenizer: one token per byte), drawn afresh for each (salt, length,
    run). Not one byte repeated: a mixture-of-experts router then sends nearly every token to the same few
    experts, so a prefill copies or computes a few of them where a real prompt (or llama-bench's random
    tokens) needs them all (sessions 4-7 measured the MoE shape's prefill that way, above its physical
    bound). Not one stream per run either: the 512-byte prompt was then the 4096-byte one's prefix, and a
    budget's prompts the next budget's, so the prefix cache served part of a prefill (session 8's first
    call read the MoE shape at 8 GiB 2.2x above its bound)."""
    rng = random.Random(f"{salt}:{n}:{run}")
    return "".join(chr(rng.randrange(33, 127)) for _ in range(n))


def prefill_tps(eng, n: int, run: int, salt: str = "", hits: list | None = None) -> float:
    """Prompt tokens / time to first token of one fresh prompt; with `hits`, appends the prefix-cache hit
    tokens the prefill saw (0 unless a prompt repeats)."""
    before = int(eng.stats().get("prefix_hit_tokens") or 0)
    for _ in eng.generate(_prompt(n, run, salt), max_new_tokens=1):
        pass
    s = eng.stats()
    if hits is not None:
        hits.append(int(s.get("prefix_hit_tokens") or 0) - before)
    return float(s["prefill_tokens_per_s"])


def decode_tps(eng, run: int, n_new: int = DECODE_TOKENS, copied: dict | None = None, salt: str = "",
               detail: list | None = None) -> float:
    """Decode tokens/s; with `copied`, also the weight bytes streamed per decode step (from the first
    token on: a MoE decode streams only routed experts); with `detail`, appends the run's token times
    (median and slowest after the first token), the host's stolen CPU share and its load meanwhile (a row's
    runs have differed by a third: session 16)."""
    from engine.bench.gpu_common import _cpu_ticks

    ex = getattr(eng, "executor", None)
    first = None
    times, last, ticks = [], time.perf_counter(), _cpu_ticks()
    # Sampled, not greedy: a random-weight model's greedy output tends to repeat one token, which routes
    # every MoE decode step to the same experts (llama-bench feeds random tokens).
    for _ in eng.generate(_prompt(DECODE_PROMPT, run, salt), max_new_tokens=n_new, temperature=1.0, seed=run):
        now = time.perf_counter()
        times.append(now - last)
        last = now
        if first is None and ex is not None:
            first = ex.copied_bytes
    if copied is not None and first is not None:
        copied["decode_copied_bytes_per_token"] = (ex.copied_bytes - first) / max(n_new - 1, 1)
    tps = float(eng.stats()["decode_tokens_per_s"])
    if detail is not None:
        after, steady = _cpu_ticks(), times[1:-1] or times    # (the last entry: the final event)
        detail.append({"tps": round(tps, 3), "median_ms": round(statistics.median(steady) * 1e3, 2),
                       "max_ms": round(max(steady) * 1e3, 2),
                       "steal_share": (round((after[1] - ticks[1]) / max(after[0] - ticks[0], 1), 4)
                                       if ticks and after else None),
                       "loadavg": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None})
    return tps


def placements_by_kind(placement: dict) -> dict[str, dict[str, int]]:
    """How many sub-layers of each kind (attn, ffn, experts (MoE expert groups), embed, head) sit where."""
    out: dict[str, dict[str, int]] = {}
    for name, p in placement.items():
        kind = "experts" if ".experts." in name else name.rsplit(".", 1)[-1]
        out.setdefault(kind, {}).setdefault(str(p), 0)
        out[kind][str(p)] += 1
    return out


def compact_plan(report: dict) -> dict:
    """Per tier: kind, predicted ms, VRAM breakdown and how many sub-layers sit where."""
    tiers = []
    for t in report.get("tiers", []):
        counts: dict[str, int] = {}
        for p in t["placement"].values():
            counts[p] = counts.get(p, 0) + 1
        tiers.append({"tokens": t["tokens"], "plan": t["plan"], "predicted_ms": t["predicted_ms"],
                      "vram": t["vram"], "placements": counts, "by_kind": placements_by_kind(t["placement"]),
                      "kv_layers": t.get("kv_layers")})
    return {"budget": report.get("budget"), "step_tokens": report.get("step_tokens"), "tiers": tiers,
            "in_use": report.get("in_use")}


def measure_budget(eng, budget: int, runs: int, poll: VramPoller) -> dict:
    eng.set_vram_budget(budget)
    _empty_cache()
    poll.samples.clear()
    t0 = time.perf_counter()
    refines0 = dict(getattr(eng, "refines", {}))
    salt = f"b{budget}"
    for n in PROMPTS:                                    # warm-up at each length
        prefill_tps(eng, n, 25, salt)
    decode_tps(eng, 24, 4, salt=salt)
    out: dict = {}
    hits: list[int] = []
    for n in PROMPTS:
        out[f"prefill{n}_tps"] = statistics.median(prefill_tps(eng, n, r, salt, hits) for r in range(runs))
    out["prefill_prefix_hit_tokens"] = sum(hits)
    # Decode: the median of DECODE_RUNS runs (a lease's speed drifts by several percent from one run of 32
    # tokens to the next; one run per budget made the row a draw)
    detail: list[dict] = []
    tps = [decode_tps(eng, runs + i, copied=out if i == 0 else None, salt=salt, detail=detail)
           for i in range(max(DECODE_RUNS, runs))]
    out["decode_tps"], out["decode_tps_runs"] = statistics.median(tps), [round(t, 3) for t in tps]
    out["decode_runs_detail"] = detail
    if hasattr(eng, "submit"):          # continuous batching: B streams submitted at once
        from engine.bench.batch_throughput import run_streams

        run_streams(eng, max(BATCHES), DECODE_PROMPT, 4, seed=97)   # warm-up: the batch tiers' first plans
        for b in BATCHES:
            r = run_streams(eng, b, DECODE_PROMPT, BATCH_NEW_TOKENS, seed=b)
            out[f"decode_batch{b}_tps"] = r["decode_aggregate_tokens_per_s"]
            out[f"decode_batch{b}_wall_tps"] = r["aggregate_tokens_per_s"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    if refines0:     # plan tables priced by the engine's background thread meanwhile (host work beside the steps)
        out["plan_refines"] = eng.refines["count"] - refines0["count"]
        out["plan_refine_s"] = round(eng.refines["seconds"] - refines0["seconds"], 2)
    return out


def _experts_line(row: dict) -> str:
    """For a MoE model: where the decode plan puts the expert groups, and the bytes a decode step copies."""
    tiers = row["plan"]["tiers"]
    experts = tiers[0]["by_kind"].get("experts") if tiers else None
    if not experts:
        return ""
    copied = row.get("decode_copied_bytes_per_token")
    return f"; decode expert groups {experts}" + (f", {copied / 2**20:.1f} MiB copied/token" if copied else "")


def unsupported_rows(scenario, budgets, reason: str) -> list[dict]:
    return [{"system": "slipstream", "model": scenario.model, "budget": name, "budget_bytes": b,
             "peak_vram_bytes": None, "prefill512_tps": None, "prefill4096_tps": None, "decode_tps": None,
             "command": None, "supported": False, "note": f"not supported yet: {reason}"}
            for name, b in budgets]


def suite_n_ctx() -> int:
    """The context an engine of the suite opens with: the longest prompt, the decode run's, and a margin."""
    return max(PROMPTS) + DECODE_TOKENS + DECODE_PROMPT + 64


def run_scenario(scenario, budgets, part, device: str, runs: int, allowance: int, command: str,
                 deadline, say=print, probe=None) -> None:
    """Slipstream's rows of one shape, one engine, the budgets ascending. `probe()`: the machine's rates
    (`gpu_common.rates_probe`), taken before the engine opens and after it closes and kept in each row
    (`lease_rates`), so the merge can set the row beside the bound at the rates of its own lease."""
    todo = [(n, b) for n, b in budgets if not part.has(f"slipstream|{scenario.model}|{n}||")]
    if not todo:
        return
    n_ctx = suite_n_ctx()
    rates = {"before": probe()} if probe is not None else None
    if rates:
        say(f"rates before: {_rates_line(rates['before'])}")
    added: list[dict] = []
    t0 = time.perf_counter()
    try:
        eng = open_engine(scenario, todo[0][1], device, n_ctx)
    except Exception as exc:  # noqa: BLE001 - an unsupported shape is a result, not a crash
        say(f"slipstream {scenario.model}: cannot open ({type(exc).__name__}: {exc})")
        (part.log_dir / f"{scenario.model}-open-error.txt").write_text(traceback.format_exc())
        for row in unsupported_rows(scenario, todo, f"{type(exc).__name__}: {exc}"):
            part.add(row)
        return
    open_s = time.perf_counter() - t0
    say(f"slipstream {scenario.model}: opened in {open_s:.0f} s")
    try:
        with VramPoller([os.getpid()], 0.02) as poll:
            for name, b in todo:
                if not deadline.allows(90):
                    say(f"  deadline: slipstream {scenario.model} at {name} left for a later call")
                    break
                try:
                    m = measure_budget(eng, b, runs, poll)
                except Exception:
                    # (kept with the logs: session 29's calls CI and CJ brought back the error's line alone)
                    (part.log_dir / f"{scenario.model}-{name}-error.txt").write_text(traceback.format_exc())
                    raise
                report = eng.plan_report()
                peak = poll.peak(os.getpid()) if poll.available else None
                row = {"system": "slipstream", "model": scenario.model, "budget": name, "budget_bytes": b,
                       "peak_vram_bytes": peak, "allowance_bytes": allowance,
                       "engine_peak_bytes": (report.get("in_use") or {}).get("peak"),
                       "process_overhead": report.get("process_overhead"),   # (what the budget loses first)
                       "fits": None if peak is None else peak <= b,   # the budget is the whole process
                       **{k: m[k] for k in m if k.endswith("_tps")},
                       "decode_copied_bytes_per_token": m.get("decode_copied_bytes_per_token"),
                       "decode_tps_runs": m.get("decode_tps_runs"),
                       "decode_runs_detail": m.get("decode_runs_detail"),
                       "plan_refines": m.get("plan_refines"), "plan_refine_s": m.get("plan_refine_s"),
                       "prefill_prefix_hit_tokens": m.get("prefill_prefix_hit_tokens"),
                       "cuda_graphs": {k: v for k, v in eng.stats().items() if k.startswith("cuda_graph")},
                       "transfer_coding": {k: v for k, v in eng.stats().items() if k.startswith("transfer_coded")},
                       "decode_batch_note": f"{BATCH_NEW_TOKENS} new tokens per stream after a {DECODE_PROMPT}-token "
                                            "prompt, all submitted at once: aggregate tokens/s from the moment "
                                            "every stream has its first token to the last token (as "
                                            "llama-batched-bench's decode figure); decode_batch*_wall_tps: "
                                            "over the whole wall time, prefill included",
                       "command": command, "plan": compact_plan(report), "open_seconds": round(open_s, 1),
                       "lease_rates": rates, "rate_probe": report.get("rate_probe"),
                       "seconds": m["seconds"], "device": device, "supported": True,
                       "note": (scenario.note + "; " if scenario.note else "")
                               + "one engine, budgets applied live with set_vram_budget, ascending"}
                part.add(row)
                added.append(row)
                (part.log_dir / f"{scenario.model}-{name}-plan.json").write_text(
                    __import__("json").dumps(report, indent=1, default=str))
                say(f"  slipstream {scenario.model} {name}: prefill {m['prefill512_tps']:.0f}/"
                    f"{m['prefill4096_tps']:.0f} t/s, decode {m['decode_tps']:.2f} t/s, peak NVML "
                    f"{(peak or 0) / 2**30:.2f} GiB, plan {[t['plan'] for t in row['plan']['tiers']]}"
                    + _experts_line(row))
    finally:
        eng.close()
        del eng
        _empty_cache()
    if rates and added:
        rates["after"] = probe()      # (the rows share the dict: each keeps both probes)
        say(f"rates after: {_rates_line(rates['after'])}")
        part.save()


def _rates_line(r: dict) -> str:
    return (f"CPU {r['cpu_gemv_gbps']} GB/s alone, {r['cpu_gemv_with_copy_gbps']} beside copies; host->GPU "
            f"{r['h2d_gbps']} alone, {r['h2d_with_cpu_gbps']} beside the CPU; steal {r['steal_share']}")
