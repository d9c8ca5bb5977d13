import json

import pytest

from engine import kernels
from engine.bench import cpu_attention_parts


@pytest.mark.parametrize("scattered", [False, True])
def test_parts_and_block_are_timed(tmp_path, capsys, scattered):
    assert cpu_attention_parts.main(["--hidden", "256", "--heads", "4", "--kv-heads", "2", "--ctx", "40",
                                     "--blocks", "2", "--reps", "3", "--out", str(tmp_path)]
                                    + ["--scattered"] * scattered) == 0
    rep = json.loads((tmp_path / "cpu_attention_parts.json").read_text())
    assert rep["ctx"] == 40 and rep["weights_bytes"] == 2 * (256 + (256 + 2 * 128) * 256 + 256 * 256)   # norm, qkv, o (head_dim 64)
    assert rep["scattered"] is scattered
    parts = {"block", "rms_norm", "qkv linear", "rope q and k", "kv write", "kv read", "sdpa", "o linear",
             "block, native attention"}
    native = kernels.attention_ready()
    assert set(rep["ms"]) == parts | ({"native attention"} if native else set())
    assert all(v > 0 for v in rep["ms"].values())
    assert 30 < rep["ops_per_block"] < 60
    if native:       # the pool read, SDPA and their glue ops replaced by one call
        assert rep["ops_per_block_native"] < rep["ops_per_block"]
    out = capsys.readouterr().out
    assert "sum of the parts" in out and "block, native attention" in out
