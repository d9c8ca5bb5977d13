"""engine.bench.ngram_speedup end to end on a tiny model: it runs both prompts with speculation off and
on, finds the outputs identical, and its step and acceptance counts agree with each other."""

from __future__ import annotations

import json

import pytest

import engine
from engine.bench import ngram_speedup


@pytest.mark.parametrize("device,budget", [("cpu", None), ("sim", "2MiB")])
def test_ngram_bench_writes_consistent_report(tiny_model, tmp_path, device, budget):
    path = tiny_model("llama", max_position_embeddings=4096)
    argv = ["--model", str(path), "--device", device, "--tokens", "24", "--out", str(tmp_path)]
    if budget:
        argv += ["--budget", budget]
    assert ngram_speedup.main(argv) == 0
    report = json.loads((tmp_path / "ngram_speedup.json").read_text())
    assert report["command"].startswith("python -m engine.bench.ngram_speedup")
    assert report["device"] == device and report["machine"]["cpu_threads"] >= 1
    assert [r["prompt"] for r in report["results"]] == list(ngram_speedup.PROMPTS)

    # The reference: the same prompt through a plain engine that never speculates.
    plain = engine.open_model(path, device="cpu", backend="torch", speculative=False)
    for row, text in zip(report["results"], ngram_speedup.PROMPTS.values()):
        assert row["identical"] and row["first_difference"] is None
        want = [e.token_id for e in plain.generate([{"role": "user", "content": text}], max_new_tokens=24)]
        assert row["output_text"] == plain.tokenizer.decode([t for t in want if t is not None])
        off, on = row["off"], row["on"]
        assert off["tokens"] == on["tokens"] and off["finish"] == on["finish"]
        assert off["proposed"] == 0 and off["decode_steps"] == off["tokens"] - 1
        assert 0 <= on["accepted"] <= on["proposed"] and on["proposed"] > 0
        # Each verify step yields one token of its own plus the proposals it accepted (the last step's
        # may be cut by max_new_tokens).
        assert on["decode_steps"] + on["accepted"] >= on["tokens"] - 1
        assert on["decode_steps"] <= off["decode_steps"]
    plain.close()
    decision = report["default_decision"]
    assert decision["rule"] == "measured step times"
    if decision["speculates"] is not None:
        assert decision["speculates"] == (decision["tokens_per_verify"] / decision["verify_ms"]
                                          >= 1.0 / decision["plain_ms"])
