"""`python -m engine plan` and `python -m engine profile` on the command line."""

from __future__ import annotations

import json

import pytest

from engine.__main__ import main
from engine.bench.shapes import SHAPES
from engine.sharding.plan import PLAN_KINDS
from engine.sharding.spec import ModelSpec

PLACEMENTS = {"resident", "streamed", "cpu"}


def test_plan_json_matches_the_plan_report_schema(capsys):
    assert main(["plan", "--model", "llama3-8b", "--budget", "4GiB", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["budget"] == 4 << 30
    names = [s.name for s in ModelSpec.from_config(SHAPES["llama3-8b"]).sublayers]
    assert [t["tokens"] for t in rep["tiers"]] == [1, 4, 16, 64, 256, 1024, 4096]
    for tier in rep["tiers"]:
        assert tier["plan"] in PLAN_KINDS
        assert isinstance(tier["predicted_ms"], float) and tier["predicted_ms"] > 0
        v = tier["vram"]
        assert set(v) == {"weights", "kv", "slots", "scratch", "total"}
        assert all(isinstance(x, int) for x in v.values())
        assert v["total"] == v["weights"] + v["kv"] + v["slots"] + v["scratch"] <= rep["budget"]
        assert list(tier["placement"]) == names and set(tier["placement"].values()) <= PLACEMENTS
        # the first kv_layers layers keep their KV in VRAM in every tier, and run attention on the GPU
        assert tier["kv_layers"] == rep["tiers"][0]["kv_layers"]
        assert all(tier["placement"][f"layers.{i}.attn"] != "cpu" for i in range(tier["kv_layers"]))


def test_plan_table(capsys):
    argv = ["plan", "--model", "qwen3-8b", "--budget", "6GiB", "--tiers", "1,256", "--kv-tokens", "8192"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "qwen3-8b" in out and "ms/step" in out and "tokens/s" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("1 ", "256 "))]
    assert len(lines) == 4        # a table row and a placement row per tier
    assert any("| H:" in ln for ln in lines)


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model", "--budget", "1GiB"], "no-such-model"),
    (["--model", "llama3-8b", "--budget", "four"], "four"),
    (["--model", "llama3-8b", "--budget", "1GiB", "--tiers", "1,x"], "--tiers"),
])
def test_plan_bad_input_is_one_line(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and "\n" not in err


def test_profile_sim_shows_the_synthetic_profile(capsys):
    assert main(["profile", "--device", "sim"]) == 0
    out = capsys.readouterr().out
    assert "notional client GPU" in out and "PCIe" in out


def _profile_file(tmp_path, h2d_scale: float = 1.0):
    from engine.sharding.profile import sim_profile_dict

    prof = sim_profile_dict()
    prof["device"] = "cuda:0"
    for k in ("h2d_gbps", "h2d_with_cpu_gbps"):
        if k in prof["link"]:
            prof["link"][k] *= h2d_scale
    path = tmp_path / "profiles.json"
    path.write_text(json.dumps({"schema": prof["schema"], "profiles": {"abc": prof}}))
    return path


def _tier1_ms(capsys, argv) -> float:
    assert main(["plan", "--model", "llama3-8b", "--budget", "4GiB", "--tiers", "1", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["tiers"][0]["predicted_ms"]


def test_plan_with_a_profile_file_uses_that_machine(tmp_path, capsys):
    """The GPU machine's stored profile plans here: the sim profile from a file plans as sim does, and a
    file with a slower PCIe link predicts a slower step."""
    same = _tier1_ms(capsys, ["--profile-file", str(_profile_file(tmp_path))])
    assert same == pytest.approx(_tier1_ms(capsys, []))
    slow = _tier1_ms(capsys, ["--profile-file", str(_profile_file(tmp_path, h2d_scale=0.1))])
    assert slow > same
    assert main(["plan", "--model", "llama3-8b", "--budget", "4GiB", "--profile-file",
                 str(_profile_file(tmp_path))]) == 0
    assert "profile cuda:0" in capsys.readouterr().out


def test_plan_with_a_bad_profile_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["plan", "--model", "llama3-8b", "--budget", "4GiB", "--profile-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "bad.json" in err and "\n" not in err


def test_plan_table_marks_attention_over_host_kv(capsys):
    """At a budget where no layer's KV fits beside the slots, the prefill tiers' attention streams over
    KV kept in host memory ('K') and decode's stays on the CPU ('C')."""
    assert main(["plan", "--model", "llama3-8b", "--budget", "1000MiB", "--tiers", "1,1024"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if "E:" in ln and "|" in ln}
    assert rows["1"].split("|")[1].split()[0][0] == "C"
    assert all(pair[0] == "K" for pair in rows["1024"].split("|")[1].split())
    assert "K streamed over its KV in host memory" in out
