import json

from engine.bench import cpu_attention_parts


def test_parts_and_block_are_timed(tmp_path, capsys):
    assert cpu_attention_parts.main(["--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ctx", "40",
                                     "--blocks", "2", "--reps", "3", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "cpu_attention_parts.json").read_text())
    assert rep["ctx"] == 40 and rep["weights_bytes"] == 2 * (256 + (256 + 2 * 128) * 256 + 256 * 256)   # norm, qkv, o (head_dim 64)
    assert set(rep["ms"]) == {"block", "rms_norm", "qkv linear", "rope q and k", "kv write", "kv read", "sdpa",
                              "o linear"}
    assert all(v > 0 for v in rep["ms"].values())
    assert 30 < rep["ops_per_block"] < 60
    assert "sum of the parts" in capsys.readouterr().out
