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
    assert "| cpu/attn |" in out and any(line.startswith("| all |") for line in out.splitlines())
    rows = price_check.compare(json.loads(report.read_text()), "batch4", profile_from_file(PROFILE), 96)
    by_kind = {r["kind"]: r for r in rows}
    spec = ModelSpec.from_config(DRY_SCENARIOS[shape].engine_config())
    prices = price_check.kind_prices(spec, profile_from_file(PROFILE), 4, 96)
    assert by_kind["cpu/attn"]["priced_ms"] == pytest.approx(prices["cpu/attn"]) and prices["cpu/attn"] > 0
    for r in rows:
        assert r["measured_ms"] >= 0 and r["per_step"] > 0
        if r["priced_ms"]:
            assert r["ratio"] == pytest.approx(r["measured_ms"] / r["priced_ms"])
    if shape == "tiny-moe":      # a router whose groups never show up alone is priced with them (a whole layer)
        assert prices["cpu/router+experts"] > prices["cpu/router"] > 0
        report_rows = json.loads(report.read_text())["rounds"]
        for r in rows:
            if r["kind"].endswith("/router"):
                place = r["kind"].split("/")[0]
                groups = [x["batch4_host_ms"].get(f"{place}/experts", (0, 0))[0] for x in report_rows]
                routers = [x["batch4_host_ms"][r["kind"]][0] for x in report_rows]
                whole = sorted(groups)[len(groups) // 2] < sorted(routers)[len(routers) // 2]
                want = prices[f"{place}/router+experts"] if whole else prices[r["kind"]]
                assert r["priced_ms"] == pytest.approx(want)


def test_price_check_says_what_is_missing(tmp_path):
    from engine.bench import price_check

    report = tmp_path / "r.json"
    report.write_text(json.dumps({"shape": "tiny-llama", "budget": "2MiB", "rounds": [{"decode_tps": 1.0}]}))
    with pytest.raises(SystemExit, match="--host-times"):
        price_check.main([str(report), "--profile-file", str(PROFILE)])
