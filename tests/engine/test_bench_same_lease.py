"""One-lease pairs of Slipstream and llama.cpp rows (engine.bench.same_lease) and their place in the merge."""

from __future__ import annotations

import json

import pytest

from engine.bench import same_lease
from engine.bench.gpu_merge import best_llamacpp, merge
from engine.bench.partials import Partial

GiB = 1 << 30


def _row(system: str, budget: str, decode: float, prefill512: float, fits: bool = True) -> dict:
    return {"system": system, "model": "llama3-8b", "budget": budget, "budget_bytes": int(budget[0]) * GiB,
            "peak_vram_bytes": int(budget[0]) * GiB - 1, "prefill512_tps": prefill512, "prefill4096_tps": None,
            "decode_tps": decode, "fits": fits, "command": f"cmd {system}"}


def _part(name: str, rows: list[dict], at: str) -> dict:
    return {"part": name, "meta": {"lease_probes": [{"at": at, "cpu_gemv_gbps": 90.0, "h2d_gbps": 55.0}]},
            "rows": rows}


def test_a_pair_takes_both_systems_rows_of_each_shared_model_and_budget():
    ss = _part("slipstream", [_row("slipstream", "4GiB", 9.5, 2000.0), _row("slipstream", "2GiB", 8.0, 1900.0)],
               "2026-11-30T17:56:00+00:00")
    ll = _part("llamacpp", [_row("llama.cpp-default", "4GiB", 6.1, 250.0),
                            _row("llama.cpp-tuned", "4GiB", 6.3, 1900.0),
                            _row("llama.cpp-tuned", "8GiB", 11.0, 3000.0)], "2026-11-30T18:02:00+00:00")
    pairs = same_lease.pair(ss, ll, "call F")
    assert [(p["model"], p["budget"]) for p in pairs] == [("llama3-8b", "4GiB")]
    p = pairs[0]
    assert [r["system"] for r in p["rows"]] == ["slipstream", "llama.cpp-default", "llama.cpp-tuned"]
    assert best_llamacpp(p["rows"], "decode_tps")["system"] == "llama.cpp-tuned"
    assert best_llamacpp(p["rows"], "prefill512_tps")["prefill512_tps"] == 1900.0
    assert "command" not in p["rows"][0] and p["call"] == "call F"


def test_parts_of_different_leases_or_without_a_shared_row_make_no_pair():
    ss = _part("slipstream", [_row("slipstream", "4GiB", 9.5, 2000.0)], "2026-11-30T17:00:00+00:00")
    far = _part("llamacpp", [_row("llama.cpp-default", "4GiB", 6.1, 250.0)], "2026-11-30T18:00:01+00:00")
    with pytest.raises(ValueError, match="apart"):
        same_lease.pair(ss, far, "x")
    other = _part("llamacpp", [_row("llama.cpp-default", "8GiB", 9.0, 500.0)], "2026-11-30T17:05:00+00:00")
    with pytest.raises(ValueError, match="share no model"):
        same_lease.pair(ss, other, "x")
    with pytest.raises(ValueError, match="lease probe"):
        same_lease.pair({"meta": {}, "rows": []}, {"meta": {}, "rows": []}, "x")


def test_the_merge_sets_each_pair_beside_the_targets(tmp_path, monkeypatch):
    """Pairs at the targeted model and budget are judged on their own lease's llama.cpp rows (the best that
    fit for the decode, llama.cpp-default for the 512-token prefill), and get a table of their own."""
    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    s = Partial(out, "slipstream", machine={"gpu": "NVIDIA H200", "cpu": "Xeon"})
    s.add(_row("slipstream", "4GiB", 10.7, 2000.0))
    ll = Partial(out, "llamacpp")
    ll.add(_row("llama.cpp-default", "4GiB", 6.95, 315.0))
    pairs = out / "same-lease.json"
    for call, decode, tuned in (("call F", 9.5, 6.3), ("call H", 9.8, 7.0)):
        a = _part("slipstream", [_row("slipstream", "4GiB", decode, 2050.0)], "2026-11-30T17:56:00+00:00")
        b = _part("llamacpp", [_row("llama.cpp-default", "4GiB", 6.1, 250.0),
                               _row("llama.cpp-tuned", "4GiB", tuned, 1900.0),
                               _row("llama.cpp-tuned", "4GiB", 99.0, 9999.0, fits=False)],
                  "2026-11-30T17:58:00+00:00")
        for name, part in (("s.json", a), ("l.json", b)):
            (tmp_path / name).write_text(json.dumps(part))
        assert same_lease.main(["--into", str(pairs), "--slipstream", str(tmp_path / "s.json"),
                                "--llamacpp", str(tmp_path / "l.json"), "--call", call]) == 0
    res = tmp_path / "results"
    assert merge([out], res, say=lambda m: None) == 0
    result = json.loads((res / "results.json").read_text())
    assert [p["call"] for p in result["one_lease"]] == ["call F", "call H"]
    mine = {(r["against"], r["metric"]): r for r in result["ratios"] if "one lease" in r["against"]}
    f = mine[("best llama.cpp, one lease (call F)", "decode")]
    assert f["peer"] == 6.3 and f["target"] == 1.5 and f["met"] is True
    h = mine[("best llama.cpp, one lease (call H)", "decode")]
    assert h["peer"] == 7.0 and h["met"] is False
    d = mine[("llama.cpp-default, one lease (call F)", "prefill 512")]
    assert d["peer"] == 250.0 and d["target"] == 10.0 and d["met"] is False
    assert mine[("best llama.cpp, one lease (call F)", "prefill 512")]["target"] is None
    md = (res / "results.md").read_text()
    assert "## One lease" in md and 'Rows against llama.cpp "one lease" set a Slipstream row' in md
    assert "| call F | llama3-8b | 4GiB | 9.50 | 6.10 / 6.30 | 1.51x | 2050 / 250 / 1900 | 4.00 / 4.00 / 4.00 |" in md
