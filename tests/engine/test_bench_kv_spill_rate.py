"""engine.bench.kv_spill_rate on this machine (a small shape, a few blocks)."""

from __future__ import annotations

import json


def test_kv_spill_rate_times_both_copy_paths_in_turns(tmp_path):
    from engine.bench import kv_spill_rate

    assert kv_spill_rate.main(["--shape", "smollm2-135m", "--tokens", "80", "--reps", "2", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kv_spill_rate.json").read_text())
    assert [r["native"] for r in report["rows"]] == [False, True, True, False]
    assert all(r["offload_ms"] > 0 and r["restore_ms"] > 0 for r in report["rows"])
    assert set(report["summary"]) == {"PyTorch, one copy each", "native pool, one call"}
    assert report["bytes"] == 80 * 30 * 2 * 3 * 64 * 2        # tokens x layers x (k, v) x kv heads x head dim x 2 B
