"""`engine.bench.part_replace`: a later call's rows of some models replace (or join) a part file's rows of
the same system, model and budget; the rest stay; meta lists grow; an archived copy stays out of the merge."""

from __future__ import annotations

import json

from engine.bench import part_replace
from engine.bench.gpu_merge import load_parts


def _part(rows, updated, commands, weights=None):
    meta = {"commands": commands, "lease_probes": [{"at": updated}]}
    if weights:
        meta["weights"] = weights
    return {"part": "slipstream", "updated": updated, "meta": meta, "rows": rows}


def _row(model, budget, tps):
    return {"system": "slipstream", "model": model, "budget": budget, "decode_tps": tps}


def test_rows_of_the_chosen_model_replace_and_join_the_rest_stay(tmp_path):
    into = tmp_path / "part-slipstream.json"
    into.write_text(json.dumps(_part([_row("llama3-8b", "4GiB", 8.6), _row("qwen3-30b-a3b", "2GiB", 21.2),
                                      _row("qwen3-30b-a3b", "4GiB", 24.1)], "2026-11-30T10:00:00+00:00",
                                     ["old"], "random_std")))
    src = tmp_path / "new.json"
    src.write_text(json.dumps(_part([_row("qwen3-30b-a3b", "4GiB", 30.0), _row("qwen3-30b-a3b", "8GiB", 29.0),
                                     _row("llama3-8b", "4GiB", 99.0)], "2026-12-01T10:00:00+00:00",
                                    ["new"], "random_std")))
    assert part_replace.main(["--into", str(into), "--source", str(src), "--models", "qwen3-30b-a3b",
                              "--note", "call KK", "--archive", "s14"]) == 0
    out = json.loads(into.read_text())
    got = {(r["model"], r["budget"]): (r["decode_tps"], r.get("call")) for r in out["rows"]}
    assert got == {("llama3-8b", "4GiB"): (8.6, None), ("qwen3-30b-a3b", "2GiB"): (21.2, None),
                   ("qwen3-30b-a3b", "4GiB"): (30.0, "call KK"), ("qwen3-30b-a3b", "8GiB"): (29.0, "call KK")}
    assert out["meta"]["commands"] == ["old", "new"] and len(out["meta"]["lease_probes"]) == 2
    assert out["meta"]["weights"] == "random_std" and out["updated"] > "2026-11-30T10:00:00+00:00"
    archived = tmp_path / "part-slipstream-s14.json"
    assert json.loads(archived.read_text())["rows"][2]["decode_tps"] == 24.1
    assert load_parts([tmp_path])["slipstream"]["rows"] == out["rows"]     # the merge reads the new file


def test_budgets_narrow_the_selection_and_other_parts_are_refused(tmp_path):
    into = tmp_path / "part-slipstream.json"
    into.write_text(json.dumps(_part([_row("m", "2GiB", 1.0), _row("m", "4GiB", 2.0)], "a", [])))
    src = tmp_path / "new.json"
    src.write_text(json.dumps(_part([_row("m", "2GiB", 5.0), _row("m", "4GiB", 6.0)], "b", [])))
    assert part_replace.main(["--into", str(into), "--source", str(src), "--budgets", "4GiB"]) == 0
    assert [r["decode_tps"] for r in json.loads(into.read_text())["rows"]] == [1.0, 6.0]
    other = dict(json.loads(src.read_text()), part="llamacpp")
    src.write_text(json.dumps(other))
    before = into.read_text()
    assert part_replace.main(["--into", str(into), "--source", str(src)]) == 2
    assert into.read_text() == before


def test_rows_of_other_weights_keep_their_own_record(tmp_path):
    """A target whose rows predate the weights record takes a call's rows of recorded weights for some
    budgets: the new rows name their weights, the old ones none, and the merge's note names only the old."""
    from engine.bench.gpu_merge import _weights_note

    into = tmp_path / "part-accelerate.json"
    into.write_text(json.dumps(_part([_row("qwen3-30b-a3b", b, 0.2) for b in ("2GiB", "4GiB", "8GiB")], "a", [])))
    src = tmp_path / "new.json"
    src.write_text(json.dumps(_part([_row("qwen3-30b-a3b", b, 0.1) for b in ("2GiB", "4GiB")], "b", [],
                                    "random_std")))
    assert part_replace.main(["--into", str(into), "--source", str(src)]) == 0
    out = json.loads(into.read_text())
    assert "weights" not in out["meta"]
    assert {r["budget"]: r.get("weights") for r in out["rows"]} == {"2GiB": "random_std", "4GiB": "random_std",
                                                                      "8GiB": None}
    assert _weights_note({"accelerate": out}).endswith("the qwen3-30b-a3b rows of accelerate (8GiB).")
    # the last old row replaced: one record again, in the meta
    src.write_text(json.dumps(_part([_row("qwen3-30b-a3b", "8GiB", 0.1)], "c", [], "random_std")))
    assert part_replace.main(["--into", str(into), "--source", str(src)]) == 0
    out = json.loads(into.read_text())
    assert out["meta"]["weights"] == "random_std" and all("weights" not in r for r in out["rows"])
    assert "Measured before" not in _weights_note({"accelerate": out})


def test_rows_whose_decode_runs_saw_cpu_steal_are_left_out_and_named(tmp_path, capsys):
    def row(budget, tps, steals):
        return dict(_row("qwen3-30b-a3b", budget, tps),
                    decode_runs_detail=[{"tps": tps, "steal_share": s} for s in steals])

    into = tmp_path / "part-slipstream.json"
    into.write_text(json.dumps(_part([_row("qwen3-30b-a3b", "2GiB", 31.9), _row("qwen3-30b-a3b", "4GiB", 35.2)],
                                     "2026-11-30T10:00:00+00:00", ["old"])))
    src = tmp_path / "new.json"
    src.write_text(json.dumps(_part([row("2GiB", 21.9, [0.002, 0.13, 0.10]), row("4GiB", 36.0, [0.0, 0.01, 0.004])],
                                    "2026-12-02T10:00:00+00:00", ["new"])))
    assert part_replace.main(["--into", str(into), "--source", str(src)]) == 0
    got = {r["budget"]: r["decode_tps"] for r in json.loads(into.read_text())["rows"]}
    assert got == {"2GiB": 31.9, "4GiB": 36.0}
    err = capsys.readouterr().err
    assert "qwen3-30b-a3b 2GiB left out" in err and "7.7% CPU steal" in err and "4GiB" not in err
    assert part_replace.main(["--into", str(into), "--source", str(src), "--max-steal", "1"]) == 0
    assert {r["budget"]: r["decode_tps"] for r in json.loads(into.read_text())["rows"]} == {"2GiB": 21.9, "4GiB": 36.0}
