"""N-gram speculation's cost on a large shape with a real acceptance pattern (issue 8).

A random-weight shape (Llama-3-8B on the GPU machine) greedily decodes nonsense, so its own acceptance
says nothing about a real code edit; the real model cannot travel there. So:

- `record_trace` runs the engine's own speculative decoding of a prompt on a real model (here, the
  bundled one) and keeps every decode step as the engine ran it: the tokens fed (the last token and the
  n-gram proposals), how many proposals the model accepted, and the token it chose next (the engine's
  `spec_observer` hook). It also decodes the prompt plainly and records whether both outputs agree.
- `replay` prefills the same number of prompt tokens on any engine and runs (a) one plain single-token
  decode step per kept token and (b) the recorded steps: each a verify forward of its fed tokens
  (`TorchEngine._verify_step`, the engine's own call, so the same plan choice for a k+1-token step),
  then the KV rolled back past the recorded accepted count (`TorchEngine._keep_accepted`). Both end at
  the same KV length (prompt + kept tokens) and feed the same tokens; the speedup is plain ms per token
  over replay ms per kept token. Token ids past the shape's vocabulary are taken modulo its size (ids do
  not change a step's cost).
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.sharding.kvcache import Sequence


def record_trace(eng, text: str, max_new_tokens: int) -> dict:
    """The speculative decode trace of one chat prompt on `eng` (greedy, speculation forced on), and the
    plain greedy decode of the same prompt for reference."""
    from engine.backends.torch_engine import SPEC_TOKENS

    messages = [{"role": "user", "content": text}]
    steps: list[dict] = []
    saved = eng.speculative
    try:
        eng.speculative = True
        eng.spec_observer = steps.append
        spec, spec_finish = _greedy(eng, messages, max_new_tokens)
        eng.spec_observer = None
        eng.speculative = False
        plain, plain_finish = _greedy(eng, messages, max_new_tokens)
    finally:
        eng.spec_observer = None
        eng.speculative = saved
    steps = [{"fed": s["fed"], "accepted": s["accepted"], "next": s["next"]} for s in steps]
    return {"prompt_ids": eng.encode_prompt(messages), "max_new_tokens": max_new_tokens,
            "spec_tokens": SPEC_TOKENS, "emitted": spec, "finish": spec_finish,
            "plain_tokens": len(plain), "plain_finish": plain_finish, "identical": spec == plain,
            "n_steps": len(steps), "proposed": sum(len(s["fed"]) - 1 for s in steps),
            "accepted": sum(s["accepted"] for s in steps), "kept_by_steps": sum(1 + s["accepted"] for s in steps),
            "steps": steps}


def _greedy(eng, messages, max_new_tokens: int) -> tuple[list[int], str]:
    ids, finish = [], None
    for ev in eng.generate(messages, max_new_tokens=max_new_tokens):
        if ev.token_id is not None:
            ids.append(ev.token_id)
        if ev.finish_reason is not None:
            finish = ev.finish_reason
    return ids, finish


def trace_tokens(trace: dict) -> list[int]:
    """The tokens the trace's steps determined, in order: the first (from the prompt), then per step the
    accepted proposals and the model's next token. The engine's output is a prefix of it (a generation
    cut by max_new_tokens stops inside its last step)."""
    steps = trace["steps"]
    if not steps:
        return list(trace["emitted"][:1])
    out = [steps[0]["fed"][0]]
    for s in steps:
        out += s["fed"][1:1 + s["accepted"]] + [s["next"]]
    return out


def plain_and_replay_steps(trace: dict, vocab_size: int):
    """(prompt ids, plain steps, replay steps) for a model of `vocab_size`: each step a (fed ids, accepted
    proposals) pair; the plain steps feed, one at a time, the tokens the replay steps keep."""
    prompt = [t % vocab_size for t in trace["prompt_ids"]]
    replay = [([t % vocab_size for t in s["fed"]], s["accepted"]) for s in trace["steps"]]
    plain = [([t], 0) for fed, acc in replay for t in fed[:1 + acc]]
    return prompt, plain, replay


def _sync(eng) -> None:
    if eng.accel is not None:
        eng.accel.synchronize()


@torch.inference_mode()
def run_steps(eng, prompt: list[int], steps: list[tuple[list[int], int]], predict: bool = True,
              probe: int | None = None) -> dict:
    """Prefill `prompt` into a new sequence, then run `steps` as the engine's speculative loop runs its
    decode steps: a verify step of the fed tokens, the KV rolled back past the accepted proposals. Per
    step: tokens fed and kept, measured ms (the step and its rollback, device synchronised), the plan that
    ran it and the planner's prediction for that plan, step size and context (sim/cuda only). With
    `probe`, also the logits of that token fed after the steps ("probe_logits": what the KV left by the
    steps yields). The sequence is released at the end (its full blocks stay cached, as after a
    generation)."""
    seq = Sequence()
    rows = []
    with eng._lock:
        try:
            eng._ensure_kv_capacity(len(prompt))
            eng._run(seq, prompt, False)
            prompt_length = seq.length
            for fed, acc in steps:
                start = seq.length
                _sync(eng)
                t0 = time.perf_counter()
                eng._verify_step(seq, fed)
                eng._keep_accepted(seq, start, len(fed) - 1, acc)
                _sync(eng)
                ms = (time.perf_counter() - t0) * 1e3
                plan = eng.executor.plan
                pred = eng.planner().estimate(plan, len(fed), start + len(fed)) \
                    if predict and eng.accel is not None and plan is not None else None
                rows.append({"fed": len(fed), "kept": acc + 1, "ms": ms, "plan": plan.kind if plan else None,
                             "tier": plan.tier if plan else None, "predicted_ms": pred})
            out = {"prompt_length": prompt_length, "kv_length": seq.length, "steps": rows}
            if probe is not None:
                out["probe_logits"] = eng._step(seq, [probe], False)[-1].float().cpu()
            return out
        finally:
            eng.executor.kv.release(seq)


def _per_token_ms(run: dict) -> float | None:
    """ms per kept token over the steps after the first (the first may switch from the prefill plan)."""
    rows = run["steps"][1:]
    kept = sum(r["kept"] for r in rows)
    return sum(r["ms"] for r in rows) / kept if kept else None


def by_step_size(runs: list[dict]) -> list[dict]:
    """Per step size (tokens fed): steps, median and mean measured ms, mean predicted ms, the plans that
    ran them (kind@tier), the first step of every run left out."""
    groups: dict[int, list[dict]] = {}
    for run in runs:
        for r in run["steps"][1:]:
            groups.setdefault(r["fed"], []).append(r)
    out = []
    for n in sorted(groups):
        g = groups[n]
        preds = [r["predicted_ms"] for r in g if r["predicted_ms"] is not None]
        out.append({"fed": n, "steps": len(g), "median_ms": statistics.median(r["ms"] for r in g),
                    "mean_ms": statistics.fmean(r["ms"] for r in g),
                    "predicted_ms": statistics.fmean(preds) if preds else None,
                    "plans": sorted({f"{r['plan']}@{r['tier']}" for r in g})})
    return out


def replay(eng, trace: dict, repeats: int = 1) -> dict:
    """Plain decoding and the trace's speculative steps on `eng`, alternated `repeats` times; medians of
    the per-token times (first step of each run left out), per step size figures pooled over the runs."""
    prompt, plain_steps, replay_steps = plain_and_replay_steps(trace, eng.config.vocab_size)
    plains, replays = [], []
    for _ in range(repeats):
        plains.append(run_steps(eng, prompt, plain_steps))
        replays.append(run_steps(eng, prompt, replay_steps))
    plain_ms = statistics.median(_per_token_ms(r) for r in plains)
    replay_ms = statistics.median(_per_token_ms(r) for r in replays)
    kept = sum(1 + acc for _, acc in replay_steps)
    return {"prompt_tokens": len(prompt), "kept_tokens": kept, "plain_steps": len(plain_steps),
            "replay_steps": len(replay_steps), "proposed": sum(len(f) - 1 for f, _ in replay_steps),
            "accepted": sum(acc for _, acc in replay_steps),
            "kv_length": {"plain": plains[-1]["kv_length"], "replay": replays[-1]["kv_length"]},
            "plain_ms_per_token": plain_ms, "replay_ms_per_token": replay_ms,
            "plain_ms_per_token_runs": [_per_token_ms(r) for r in plains],
            "replay_ms_per_token_runs": [_per_token_ms(r) for r in replays],
            "speedup": plain_ms / replay_ms if plain_ms and replay_ms else None,
            "plain_by_step_size": by_step_size(plains), "replay_by_step_size": by_step_size(replays)}
