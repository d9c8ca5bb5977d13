"""What n-gram (prompt lookup) speculative decoding gains on a code-editing prompt, whose answer mostly
copies the prompt, against a summary prompt, whose answer does not (issue 8).

    python -m engine.bench.ngram_speedup [--model PATH] [--device cpu|sim|cuda] [--budget 1GiB]
                                         [--tokens 200] [--repeats 1] [--out docs/benchmarks] [--note TEXT]

Each prompt goes through the chat template and is decoded greedily with speculation off and on (the same
engine, runs alternated `--repeats` times, the median kept). Reported per prompt and mode: decode
tokens/s (first token to last, prefill excluded), the speedup, proposals accepted / proposed, tokens per
decode step, and whether both outputs are identical token for token (greedy speculation must not change
them; the script exits 1 if they differ). Also recorded: what the engine decides by default
(`speculative=None`) on this device from the step times it measured (plain and verify steps). Writes `<out>/ngram_speedup.json` (command, machine, date, results).

Default model: the bundled SmolLM2-135M-Instruct (Q4_1 GGUF). On CUDA a small `--budget` streams the
weights, so each step is bound by the bytes it moves and extra verified tokens cost little: where
speculation pays. On the CPU a step's cost grows with its tokens, so it may not.

A large shape with a real acceptance pattern (engine.bench.ngram_replay):

    python -m engine.bench.ngram_speedup --record docs/benchmarks/ngram_trace_code_edit.json [--tokens N]
    python -m engine.bench.ngram_speedup --shape llama3-8b --budget 4GiB --device cuda
                                         [--trace docs/benchmarks/ngram_trace_code_edit.json] [--repeats 2]

`--record` keeps the code-edit prompt's speculative decode steps on the (bundled) model. `--shape` opens
random weights of a named shape (engine.bench.shapes, or a dry-run shape of engine.bench.scenarios such
as tiny-llama), replays that trace against plain decoding of the same tokens (the trace's acceptance,
this shape's step costs), then runs the shape's own n-gram speculation on the code-edit prompt (its own
acceptance on random weights, and whether its greedy output equals plain decoding). Writes
`<out>/ngram_replay_<shape>.json`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from engine.bench.gpu_common import write_report

CODE = '''\
def summarize_orders(rows, cutoff_date, currency="EUR"):
    """Group paid orders after cutoff_date by customer and return per-customer totals."""
    totals = {}
    counts = {}
    latest = {}
    skipped = 0
    for row in rows:
        if row.get("status") != "paid":
            skipped += 1
            continue
        date = row.get("date")
        if date is None or date < cutoff_date:
            skipped += 1
            continue
        customer = row.get("customer_id")
        if customer is None:
            skipped += 1
            continue
        amount = row.get("amount", 0.0)
        if row.get("currency", currency) != currency:
            rate = row.get("rate")
            if not rate:
                skipped += 1
                continue
            amount = amount * rate
        discount = row.get("discount", 0.0)
        if discount:
            amount = amount * (1.0 - discount)
        totals[customer] = totals.get(customer, 0.0) + amount
        counts[customer] = counts.get(customer, 0) + 1
        if customer not in latest or date > latest[customer]:
            latest[customer] = date
    result = []
    for customer, total in totals.items():
        count = counts[customer]
        average = total / count if count else 0.0
        result.append(
            {
                "customer_id": customer,
                "total": round(total, 2),
                "orders": count,
                "average": round(average, 2),
                "last_order": latest[customer],
                "currency": currency,
            }
        )
    result.sort(key=lambda item: item["total"], reverse=True)
    grand_total = sum(item["total"] for item in result)
    for item in result:
        if grand_total:
            item["share"] = round(item["total"] / grand_total, 4)
        else:
            item["share"] = 0.0
    summary = {
        "customers": len(result),
        "skipped": skipped,
        "grand_total": round(grand_total, 2),
        "rows": result,
    }
    return summary
'''

PARAGRAPH = (
    "The city council voted on Tuesday to turn the disused rail yard on the east side into a public park "
    "with community gardens, a covered market hall and a cycle path linking the river to the old town. "
    "Supporters said the project would give the densest neighbourhoods their first large green space and "
    "bring weekend trade to nearby shops; opponents worried about the cost of cleaning the contaminated "
    "soil, estimated at twelve million, and asked why housing had not been considered for the site. The "
    "plan passes to a public consultation in the spring, and work could begin the following year if the "
    "regional government agrees to pay a third of the clean-up bill.")

PROMPTS = {
    "code_edit": ("Rename the variable `row` to `order` in this function and add type hints to its "
                  "signature. Return the whole function, nothing else.\n\n```python\n" + CODE + "```"),
    "summarise": "Summarise this paragraph in three sentences.\n\n" + PARAGRAPH,
}
TRACE = "docs/benchmarks/ngram_trace_code_edit.json"   # the code-edit prompt's recorded decode steps


def _decode(eng, messages, max_new_tokens: int) -> dict:
    """One greedy generation: its token ids, decode time (first token to the end) and decode steps."""
    steps = [0]
    inner = eng._step_batch

    def counted(items):
        steps[0] += 1
        return inner(items)

    eng._step_batch = counted            # count the engine's forward steps for this run
    before = eng.stats()
    ids, final = [], None
    t_first = steps_at_first = None
    try:
        for ev in eng.generate(messages, max_new_tokens=max_new_tokens):
            if t_first is None:          # the prompt is in; no decode step has run yet
                t_first, steps_at_first = time.perf_counter(), steps[0]
            if ev.token_id is not None:
                ids.append(ev.token_id)
            if ev.finish_reason is not None:
                final = ev
        t_end = time.perf_counter()
    finally:
        del eng._step_batch              # the class's method again
    after = eng.stats()
    n = final.index                      # tokens generated, an end-of-sequence token included
    decode_steps = steps[0] - steps_at_first
    proposed = after["spec_proposed"] - before["spec_proposed"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    decode_s = t_end - t_first
    return {"tokens": n, "finish": final.finish_reason, "ids": ids, "decode_s": decode_s,
            "tokens_per_s": (n - 1) / max(decode_s, 1e-9) if n > 1 else None,
            "decode_steps": decode_steps, "ms_per_step": 1e3 * decode_s / decode_steps if decode_steps else None,
            "tokens_per_step": (n - 1) / decode_steps if decode_steps else None,
            "proposed": proposed, "accepted": accepted,
            "acceptance": accepted / proposed if proposed else None}


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mode_row(runs: list[dict]) -> dict:
    """The median run (by tokens/s) of one mode, with every run's rate kept."""
    rates = [r["tokens_per_s"] or 0.0 for r in runs]
    med = statistics.median_low(rates)
    row = dict(runs[rates.index(med)])
    row.pop("ids")
    row["tokens_per_s_runs"] = rates
    return row


def measure_prompt(eng, name: str, text: str, max_new_tokens: int, repeats: int) -> dict:
    messages = [{"role": "user", "content": text}]
    runs = {False: [], True: []}
    for _ in range(repeats):
        for mode in (False, True):
            eng.speculative = mode
            runs[mode].append(_decode(eng, messages, max_new_tokens))
    ref = runs[False][0]["ids"]
    diffs = [_first_difference(ref, r["ids"]) for mode in (False, True) for r in runs[mode]]
    off, on = _mode_row(runs[False]), _mode_row(runs[True])
    speedup = on["tokens_per_s"] / off["tokens_per_s"] if on["tokens_per_s"] and off["tokens_per_s"] else None
    step_cost = on["ms_per_step"] / off["ms_per_step"] if on["ms_per_step"] and off["ms_per_step"] else None
    return {"prompt": name, "prompt_tokens": len(eng.encode_prompt(messages)), "off": off, "on": on,
            "speedup": speedup, "measured_step_cost_ratio": step_cost, "identical": all(d is None for d in diffs),
            "first_difference": next((d for d in diffs if d is not None), None),
            "output_text": eng.tokenizer.decode(ref)}


def default_decision(eng) -> dict:
    """What `speculative=None` (the default) decides on this engine after the runs: it times plain and
    verify steps and proposes while a verify step yields more tokens per millisecond (see
    TorchEngine._propose_now); the measured figures behind the decision."""
    from engine.backends.torch_engine import SPEC_TOKENS

    t = eng._spec_timing
    out = {"rule": "measured step times", "spec_tokens": SPEC_TOKENS, "plain_ms": t["plain"],
           "verify_ms": t["verify"], "tokens_per_verify": t["gain"]}
    out["speculates"] = None if t["plain"] is None or t["verify"] is None else \
        t["gain"] / t["verify"] >= 1.0 / t["plain"]
    return out


def print_table(rows: list[dict]) -> None:
    print("| prompt | mode | tokens | tokens/s | speedup | accepted / proposed | tokens per step | ms per step "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for mode in ("off", "on"):
            m = r[mode]
            acc = f"{m['accepted']} / {m['proposed']} ({m['acceptance']:.2f})" if m["proposed"] else "-"
            speed = f"{r['speedup']:.2f}x" if mode == "on" and r["speedup"] else ""
            tps = f"{m['tokens_per_s']:.1f}" if m["tokens_per_s"] else "-"
            tstep = f"{m['tokens_per_step']:.2f}" if m["tokens_per_step"] else "-"
            mstep = f"{m['ms_per_step']:.0f}" if m["ms_per_step"] else "-"
            same = "yes" if r["identical"] else f"NO (from token {r['first_difference']})"
            print(f"| {r['prompt']} | speculation {mode} | {m['tokens']} | {tps} | {speed} | {acc} | {tstep} | "
                  f"{mstep} | {same} |")


def main(argv=None) -> int:
    import torch

    import engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file or Hugging Face folder (default: the bundled model)")
    ap.add_argument("--device", default="cpu", help="cpu, sim or cuda")
    ap.add_argument("--budget", default=None, help="VRAM budget (sim/cuda), e.g. 64MiB: weights stream")
    ap.add_argument("--tokens", type=int, default=200, help="new tokens per generation")
    ap.add_argument("--repeats", type=int, default=1, help="off/on pairs per prompt; the median is kept")
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--note", default="", help="free text kept in the report (e.g. the machine's load)")
    ap.add_argument("--record", default=None, metavar="PATH",
                    help="record the code-edit prompt's speculative decode trace to PATH (JSON) and stop")
    ap.add_argument("--shape", default=None, help="replay a trace on random weights of this named shape")
    ap.add_argument("--trace", default=TRACE, help=f"the trace --shape replays (default {TRACE})")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        ap.error("--tokens must be 2 or more and --repeats 1 or more")
    command = " ".join(["python -m engine.bench.ngram_speedup"] + (sys.argv[1:] if argv is None else list(argv)))
    if args.record:
        return record_main(args, command)
    if args.shape:
        return shape_main(args, command)
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    eng = engine.open_model(args.model, device=args.device, vram_budget=args.budget, backend="torch")
    try:
        rows = [measure_prompt(eng, name, text, args.tokens, args.repeats) for name, text in PROMPTS.items()]
        decision = default_decision(eng)
        info = {"model": Path(eng.source).name, "device": eng.device, "budget": args.budget,
                "plan": eng.stats().get("plan"), "torch_threads": torch.get_num_threads()}
    finally:
        eng.close()
    print_table(rows)
    print(f"default (speculative=None) on {info['device']}: "
          f"{ {True: 'speculates', False: 'does not speculate', None: 'not yet measured'}[decision['speculates']] }"
          + (f" (plain step {decision['plain_ms']:.1f} ms, verify step {decision['verify_ms']:.1f} ms yielding "
             f"{decision['tokens_per_verify']:.2f} tokens)" if decision["speculates"] is not None else ""))
    payload = {**info, "tokens": args.tokens, "repeats": args.repeats, "note": args.note,
               "load_average_1m": {"start": load_start,
                                   "end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None},
               "default_decision": decision, "results": rows}
    path = write_report(Path(args.out), "ngram_speedup", payload, command)
    print(f"wrote {path}")
    if not all(r["identical"] for r in rows):
        print("speculation changed the greedy output", file=sys.stderr)
        return 1
    return 0



def record_main(args, command: str) -> int:
    """--record: the code-edit prompt's speculative decode trace on the (bundled) model."""
    import engine
    from engine.bench.ngram_replay import record_trace, trace_tokens

    eng = engine.open_model(args.model, device=args.device, vram_budget=args.budget, backend="torch")
    try:
        trace = record_trace(eng, PROMPTS["code_edit"], args.tokens)
        model = Path(eng.source).name
    finally:
        eng.close()
    made = trace_tokens(trace)
    print(f"{model}, code_edit: {len(trace['prompt_ids'])} prompt tokens, {len(trace['emitted'])} emitted "
          f"({trace['finish']}), {trace['n_steps']} decode steps, accepted {trace['accepted']} / proposed "
          f"{trace['proposed']}, plain decoding {trace['plain_tokens']} tokens, identical: {trace['identical']}")
    out = Path(args.record)
    path = write_report(out.parent, out.stem, {"prompt": "code_edit", "model": model, "device": args.device,
                                              "note": args.note, **trace}, command)
    print(f"wrote {path}")
    if not trace["identical"] or made[:len(trace["emitted"])] != trace["emitted"]:
        print("the trace does not reproduce plain greedy decoding", file=sys.stderr)
        return 1
    return 0


def open_bench_shape(shape: str, budget, device: str, n_ctx: int):
    """Random weights of a named shape (engine.bench.shapes) or a dry-run shape (tiny-llama, ...)."""
    from engine.backends.torch_engine import TorchEngine
    from engine.bench.gpu_common import open_shape
    from engine.bench.scenarios import DRY_CONFIGS
    from engine.loading.random_init import random_model

    if shape not in DRY_CONFIGS:
        return open_shape(shape, budget, device=device, n_ctx=n_ctx)
    return TorchEngine(random_model(DRY_CONFIGS[shape](), seed=0, name=shape), device=device,
                       vram_budget=budget, n_ctx=n_ctx, speculative=False)


def print_replay(rep: dict, own: dict) -> None:
    print("| run | tokens | decode steps | ms per token | speedup | accepted / proposed |")
    print("|---|---|---|---|---|---|")
    print(f"| plain decoding, the trace's tokens | {rep['kept_tokens']} | {rep['plain_steps']} | "
          f"{rep['plain_ms_per_token']:.2f} | | - |")
    print(f"| replay of the recorded code-edit trace (real acceptance) | {rep['kept_tokens']} | "
          f"{rep['replay_steps']} | {rep['replay_ms_per_token']:.2f} | {rep['speedup']:.2f}x | "
          f"{rep['accepted']} / {rep['proposed']} |")
    for mode in ("off", "on"):
        m = own[mode]
        ms = f"{1e3 / m['tokens_per_s']:.2f}" if m["tokens_per_s"] else "-"
        acc = f"{m['accepted']} / {m['proposed']}" if m["proposed"] else "-"
        speed = f"{own['speedup']:.2f}x" if mode == "on" and own["speedup"] else ""
        print(f"| this shape's own speculation {mode} (random weights) | {m['tokens']} | {m['decode_steps']} | "
              f"{ms} | {speed} | {acc} |")
    print("\n| mode | tokens per step | steps | plan | median ms | mean ms | predicted ms |")
    print("|---|---|---|---|---|---|---|")
    for mode in ("plain", "replay"):
        for r in rep[f"{mode}_by_step_size"]:
            pred = f"{r['predicted_ms']:.2f}" if r["predicted_ms"] is not None else "-"
            print(f"| {mode} | {r['fed']} | {r['steps']} | {', '.join(r['plans'])} | {r['median_ms']:.2f} | "
                  f"{r['mean_ms']:.2f} | {pred} |")


def shape_main(args, command: str) -> int:
    """--shape: replay the trace on random weights of the shape, then the shape's own speculation."""
    import json

    import torch

    from engine.bench.ngram_replay import replay

    trace = json.loads(Path(args.trace).read_text())
    n_ctx = max(4096, len(trace["prompt_ids"]) + trace["kept_by_steps"] + 64)
    eng = open_bench_shape(args.shape, args.budget, args.device, n_ctx)
    try:
        rep = replay(eng, trace, args.repeats)
        rep["kv_tokens"] = eng.kv_tokens           # the KV capacity the plans were made for
        own = measure_prompt(eng, "code_edit", PROMPTS["code_edit"], args.tokens, args.repeats)
        own["kv_tokens"] = eng.kv_tokens           # grows (a re-plan) where its prompt needs more
        decision = default_decision(eng)
        plans = [{k: v for k, v in p.report().items() if k != "placement"} for p in eng.planset.plans] \
            if eng.planset is not None else None
        info = {"shape": args.shape, "device": eng.device, "budget": args.budget, "plans": plans,
                "torch_threads": torch.get_num_threads()}
    finally:
        eng.close()
    own.pop("output_text")               # random weights: the text means nothing
    print(f"{args.shape} on {info['device']}, budget {args.budget}: trace {args.trace} "
          f"({trace['model']}, {len(trace['prompt_ids'])} prompt tokens)")
    print_replay(rep, own)
    payload = {**info, "trace": args.trace, "trace_model": trace["model"], "repeats": args.repeats,
               "tokens": args.tokens, "note": args.note, "replay": rep,
               "own_speculation": {"label": "this shape's random weights: its own acceptance, not a code edit's",
                                   **own},
               "default_decision": decision}
    path = write_report(Path(args.out), f"ngram_replay_{args.shape}", payload, command)
    print(f"wrote {path}")
    if not own["identical"]:
        print("speculation changed the greedy output", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
