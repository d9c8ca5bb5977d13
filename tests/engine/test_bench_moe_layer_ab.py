"""`engine.bench.moe_layer_ab` (dry run on the sim device, the tiny MoE shape): decode alternating with the
CPU layer call on and off in one engine, a row per budget with both ways' rates and the greedy check."""

from __future__ import annotations

import json

from engine import kernels
from engine.bench import moe_layer_ab


def test_layer_call_ab_writes_a_row_per_budget_and_compares_greedy_tokens(tmp_path, monkeypatch):
    calls = []
    real = kernels.moe_layer
    monkeypatch.setattr(kernels, "moe_layer", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert moe_layer_ab.main(["--shape", "tiny-moe", "--layers", "0", "--device", "sim", "--budgets", "1GiB,64MiB",
                              "--reps", "2", "--tokens", "5", "--prompt", "12", "--batches", "3",
                              "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_layer_ab.json").read_text())
    assert report["shape"] == "tiny-moe" and [r["budget"] for r in report["rows"]] == ["1GiB", "64MiB"]
    for row in report["rows"]:
        assert len(row["on_tps"]) == len(row["off_tps"]) == 2 and min(row["on_tps"] + row["off_tps"]) > 0
        assert row["greedy_same_tokens"] is True       # the layer call changes speed, never the tokens
        assert row["decode_plan"]["predicted_ms"] > 0 and row["decode_plan"]["by_kind"]["experts"]
        three = row["batches"]["3"]
        assert len(three["on_tps"]) == len(three["off_tps"]) == 2 and min(three["on_tps"] + three["off_tps"]) > 0
    assert calls or kernels._load() is None             # (64 MiB puts routers and experts on the CPU)
