"""`engine.bench.cpu_calls_ab` on the tiny dense shape: decode with the CPU layer calls on and off in one
engine, the rows' times, the same tokens both ways, the attention call taken when on."""

from __future__ import annotations

import json

from engine import kernels
from engine.bench import cpu_calls_ab


def test_cpu_calls_ab_runs_both_ways_and_gets_the_same_tokens(tmp_path, monkeypatch):
    calls = []
    real = kernels.attention_decode
    monkeypatch.setattr(kernels, "attention_decode", lambda *a, **kw: calls.append(real(*a, **kw)) or calls[-1])
    assert cpu_calls_ab.main(["--shape", "tiny-llama", "--tokens", "6", "--rounds", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_calls_ab_tiny-llama.json").read_text())
    assert len(report["on_ms"]) == len(report["off_ms"]) == 2 and min(report["on_ms"] + report["off_ms"]) > 0
    assert report["same_tokens"] is True and report["command"].startswith("python -m engine.bench.cpu_calls_ab")
    assert any(c is not None for c in calls) or not kernels.attention_ready()
