"""`engine.bench.host_costs` (dry run on the sim device): the executor's sub-layer timer counts every
sub-layer of each decode step under its placement and kind, beside the estimator's price for it."""

from __future__ import annotations

import json

from engine.bench import host_costs


def test_host_costs_times_every_sublayer_of_each_decode_step(tmp_path):
    assert host_costs.main(["--device", "sim", "--shape", "tiny-moe", "--budget", "1GiB", "--kinds",
                            "gpu_only,static", "--tokens", "6", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "host_costs.json").read_text())
    by_kind = {r["kind"]: {row["kind"]: row for row in r["rows"]} for r in report["results"]}
    on_gpu, on_cpu = by_kind["gpu_only"], by_kind["static"]
    layers = 2                                          # the tiny MoE shape
    assert on_gpu["resident/attn"]["per_step"] == layers and on_gpu["resident/router"]["per_step"] == layers
    assert on_gpu["resident/head"]["per_step"] == 1
    assert all(row["measured_ms_each"] > 0 for row in on_gpu.values() if row["per_step"])
    assert all(row["predicted_ms_per_step"] >= 0 for row in on_gpu.values())
    assert "cpu/experts" in on_cpu or "resident/experts" in on_cpu
    # embed, and each layer's attention and router; a layer whose router and experts are all on the CPU runs
    # as one native call (`moe.layer_cpu`), timed under its router
    assert sum(row["per_step"] for row in on_cpu.values()) >= 1 + 2 * layers
