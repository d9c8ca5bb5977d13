"""`engine.bench.kv_capacity_plans`: the decode plan by budget and KV capacity from a stored profile, planning
only. A larger capacity books more KV on the GPU attention layers, so its plan never predicts faster."""

from __future__ import annotations

import json
from pathlib import Path

from engine.bench import kv_capacity_plans
from engine.sharding.device import ALLOCATOR_MARGIN

PROFILE = str(Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json")


def test_a_larger_kv_capacity_never_predicts_a_faster_decode(tmp_path):
    assert kv_capacity_plans.main(["--profile-file", PROFILE, "--models", "llama3-8b", "--budgets", "4GiB",
                                   "--kv-tokens", "2048,8704", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "kv_capacity_plans.json").read_text())
    small, large = rep["rows"]
    assert (small["kv_tokens"], large["kv_tokens"]) == (2048, 8704)
    assert small["predicted_ms"] <= large["predicted_ms"]
    assert rep["command"].startswith("python -m engine.bench.kv_capacity_plans")


def test_bookable_is_the_budget_less_overhead_and_margin():
    gib = 1 << 30
    assert kv_capacity_plans.bookable(4 * gib, 800 << 20) == 4 * gib - (800 << 20) - max(
        ALLOCATOR_MARGIN[0], int(4 * gib * ALLOCATOR_MARGIN[1]))
    assert kv_capacity_plans.bookable(gib, 2 * gib) == 0
