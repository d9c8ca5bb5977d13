"""The n-gram trace recorder and its replay (engine.bench.ngram_replay): the recorded steps are what the
engine's speculative decoding ran (they rebuild its output, which equals plain greedy decoding), and a
replay on another shape feeds and keeps exactly the trace's tokens, leaving the KV as plain decoding of
the same tokens does."""

from __future__ import annotations

import json

import pytest
import torch

import engine
from engine.bench import ngram_speedup
from engine.bench.ngram_replay import plain_and_replay_steps, record_trace, replay, run_steps, trace_tokens

TEXT = "Repeat this list twice: alpha beta gamma delta epsilon zeta eta theta iota kappa"


@pytest.fixture(scope="module")
def recorded(tiny_model):
    path = tiny_model("llama", max_position_embeddings=4096)
    eng = engine.open_model(path, device="cpu", backend="torch")
    try:
        trace = record_trace(eng, TEXT, 40)
        prompt = eng.encode_prompt([{"role": "user", "content": TEXT}])
    finally:
        eng.close()
    plain = engine.open_model(path, device="cpu", backend="torch", speculative=False)
    try:
        want = [e.token_id for e in plain.generate([{"role": "user", "content": TEXT}], max_new_tokens=40)
                if e.token_id is not None]
    finally:
        plain.close()
    return trace, prompt, want


def test_recorded_trace_is_what_the_engine_ran(recorded):
    trace, prompt, want = recorded
    assert trace["prompt_ids"] == prompt
    assert trace["emitted"] == want and trace["identical"] and trace["plain_tokens"] == len(want)
    steps = trace["steps"]
    assert steps and trace["proposed"] > 0
    assert trace["n_steps"] == len(steps)
    assert trace["accepted"] == sum(s["accepted"] for s in steps)
    assert all(0 <= s["accepted"] <= len(s["fed"]) - 1 <= trace["spec_tokens"] for s in steps)
    # The steps rebuild the engine's output: each accepted proposal and next token is plain greedy's.
    made = trace_tokens(trace)
    assert made[:len(want)] == want
    assert len(made) - len(want) <= trace["spec_tokens"] + 1       # the last step may run past max_new_tokens
    # Each step's rejected proposal (where one was) differs from the token greedy decoding chose there.
    pos = 0
    for s in steps:
        pos += 1 + s["accepted"]
        if s["accepted"] < len(s["fed"]) - 1 and pos < len(want):
            assert s["fed"][1 + s["accepted"]] != made[pos]


def test_replay_on_a_tiny_shape_keeps_the_traces_tokens(recorded):
    trace, _, _ = recorded
    eng = ngram_speedup.open_bench_shape("tiny-llama", "2MiB", "sim", n_ctx=1024)
    try:
        prompt, plain_steps, replay_steps = plain_and_replay_steps(trace, eng.config.vocab_size)
        assert len(prompt) == len(trace["prompt_ids"])
        probe = prompt[0]
        plain = run_steps(eng, prompt, plain_steps, probe=probe)
        rep = run_steps(eng, prompt, replay_steps, probe=probe)
        kept = trace["kept_by_steps"]
        assert kept == len(trace_tokens(trace)) - 1
        assert [(r["fed"], r["kept"]) for r in rep["steps"]] == \
            [(len(s["fed"]), 1 + s["accepted"]) for s in trace["steps"]]
        assert sum(r["kept"] for r in plain["steps"]) == kept and all(r["fed"] == 1 for r in plain["steps"])
        assert plain["kv_length"] == rep["kv_length"] == len(prompt) + kept
        # The rollback left the KV as plain decoding of the same tokens did: the next token's logits agree.
        assert torch.allclose(plain["probe_logits"], rep["probe_logits"], atol=0.02, rtol=0.02)
        # Steps of up to 16 tokens run under a small-step plan.
        assert all(r["tier"] is not None and r["tier"] <= 16 for r in rep["steps"][1:])
        summary = replay(eng, trace)
        assert summary["kept_tokens"] == kept and summary["replay_steps"] == len(trace["steps"])
        assert summary["accepted"] == trace["accepted"] and summary["proposed"] == trace["proposed"]
        assert summary["kv_length"] == {"plain": len(prompt) + kept, "replay": len(prompt) + kept}
    finally:
        eng.close()


def test_cli_records_and_replays(tiny_model, tmp_path):
    path = tiny_model("llama", max_position_embeddings=4096)
    trace_path = tmp_path / "trace.json"
    assert ngram_speedup.main(["--model", str(path), "--record", str(trace_path), "--tokens", "24"]) == 0
    trace = json.loads(trace_path.read_text())
    assert trace["command"].startswith("python -m engine.bench.ngram_speedup") and trace["identical"]
    assert trace["prompt"] == "code_edit" and trace["machine"]["cpu_threads"] >= 1
    assert ngram_speedup.main(["--device", "sim", "--shape", "tiny-llama", "--budget", "2MiB", "--trace",
                               str(trace_path), "--tokens", "16", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "ngram_replay_tiny-llama.json").read_text())
    rep = report["replay"]
    assert rep["kept_tokens"] == trace["kept_by_steps"] and rep["replay_steps"] == trace["n_steps"]
    assert sum(r["steps"] for r in rep["replay_by_step_size"]) == trace["n_steps"] - 1  # first left out
    assert all(r["predicted_ms"] is not None for r in rep["replay_by_step_size"])
    own = report["own_speculation"]
    assert own["identical"] and own["on"]["tokens"] == own["off"]["tokens"] == 16
    assert "random weights" in own["label"]
