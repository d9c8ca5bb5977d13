"""engine.bench.cpu_matmul on this machine's CPU: the rows it times, the engine's path and the profile's price."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

H200 = Path(__file__).parents[2] / "docs/benchmarks/profiles/h200.json"


def test_cpu_matmul_times_each_path_and_sets_the_profiles_price_beside(tmp_path):
    from engine.bench import cpu_matmul

    assert cpu_matmul.main(["--hidden", "256", "--ffn", "512", "--rows", "1,8", "--dtypes", "bfloat16",
                            "--rotate-gib", "0.01", "--min-s", "0.01", "--engine-path",
                            "--profile-file", str(H200), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_matmul.json").read_text())
    assert [r["rows"] for r in report["matmul"]] == [1, 8]
    for r in report["matmul"]:
        assert r["torch_gbps"] > 0 and r["engine_gbps"] > 0 and r["priced_gbps"] > 0
        assert r["torch_gflops"] == round(r["torch_gbps"] * 2 * r["rows"] / 2, 1)
    assert report["profile_file"] == str(H200) and report["beside_copies_gbps"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_beside_copies_needs_cuda(capsys):
    from engine.bench import cpu_matmul

    assert cpu_matmul.main(["--beside-copies"]) == 1
    assert "needs CUDA" in capsys.readouterr().err
