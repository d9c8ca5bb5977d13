"""engine.bench.moe_cpu_experts on a tiny MoE shape: the experts' path and the whole layer in one call."""

from __future__ import annotations

import json


def test_each_batch_times_the_experts_and_the_layer_call(tmp_path):
    from engine import kernels
    from engine.bench import moe_cpu_experts

    assert moe_cpu_experts.main(["--shape", "tiny-moe", "--layers", "2", "--tokens", "8", "--batches", "1,2",
                                 "--gap-us", "50", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "moe_cpu_experts.json").read_text())
    assert report["gap_us"] == 50 and report["pinned"] is False
    assert [r["batch"] for r in report["batches"]] == [1, 2]
    for r in report["batches"]:
        assert r["experts_ms"] > 0 and r["touched_experts"] >= 1
        if kernels.status(wait=True).startswith("native"):
            assert r["layer_call_ms"] > 0 and r["layer_call_gbps"] > 0
