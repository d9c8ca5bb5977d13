"""engine.bench.price_check: a share_ab report's host times per kind beside the estimator's prices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

PROFILE = Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json"


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-moe"])
def test_price_check_sets_each_kind_beside_its_price(tmp_path, capsys, shape):
    from engine.bench import price_check, share_ab
    from engine.bench.scenarios import DRY_SCENARIOS
    from engine.commands.plan import profile_from_file
    from engine.sharding.spec import ModelSpec

    assert share_ab.main(["--shape", shape, "--budget", "2MiB", "--device", "sim", "--moves", "none;layers.*.attn",
                          "--rounds", "1", "--parts", "decode,batch", "--host-times", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    report = tmp_path / "share_ab.json"
    assert price_check.main([str(report), "--profile-file", str(PROFILE)]) == 0
    out = capsys.readouterr().out
    assert "| cpu/attn |" in out and out.strip().splitlines()[-1].startswith("| all |")
    rows = price_check.compare(json.loads(report.read_text()), "batch4", profile_from_file(PROFILE), 96)
    by_kind = {r["kind"]: r for r in rows}
    spec = ModelSpec.from_config(DRY_SCENARIOS[shape].engine_config())
    prices = price_check.kind_prices(spec, profile_from_file(PROFILE), 4, 96)
    assert by_kind["cpu/attn"]["priced_ms"] == pytest.approx(prices["cpu/attn"]) and prices["cpu/attn"] > 0
    for r in rows:
        assert r["measured_ms"] >= 0 and r["per_step"] > 0
        if r["priced_ms"]:
            assert r["ratio"] == pytest.approx(r["measured_ms"] / r["priced_ms"])
    if shape == "tiny-moe":      # a CPU router's price holds its layer's expert groups (the one-call layer)
        alone = price_check.kind_prices(spec, profile_from_file(PROFILE), 1, 96)
        from engine.sharding.estimator import step_costs

        costs = step_costs(spec, profile_from_file(PROFILE), 1, 96)
        routers = [i for i, s in enumerate(spec.sublayers) if s.kind == "router"]
        assert alone["cpu/router"] > sum(costs.cpu_ms[i] for i in routers) / len(routers)


def test_price_check_says_what_is_missing(tmp_path):
    from engine.bench import price_check

    report = tmp_path / "r.json"
    report.write_text(json.dumps({"shape": "tiny-llama", "budget": "2MiB", "rounds": [{"decode_tps": 1.0}]}))
    with pytest.raises(SystemExit, match="--host-times"):
        price_check.main([str(report), "--profile-file", str(PROFILE)])
