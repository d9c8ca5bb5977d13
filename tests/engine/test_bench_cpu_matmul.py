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


def test_cpu_matmul_takes_turns_at_prefetch_distances_and_puts_the_default_back(tmp_path):
    """`--prefetch 0,512,0,512`: the native path and the FFN block are timed at each distance in turns, each
    row reports every distance's median and its turns, and the kernel's own distance is back afterwards."""
    from engine import kernels
    from engine.bench import cpu_matmul

    if kernels._load() is None:
        pytest.skip(f"no native kernel: {kernels.status()}")
    before = kernels.prefetch()
    assert cpu_matmul.main(["--hidden", "4096", "--ffn", "256", "--rows", "1", "--dtypes", "bfloat16",
                            "--rotate-gib", "0.02", "--min-s", "0.01", "--prefetch", "0,512,0,512",
                            "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_matmul.json").read_text())
    (row,) = report["matmul"]
    for pf in (0, 512):
        assert row[f"native_pf{pf}_gbps"] > 0 and len(row[f"native_pf{pf}_turns_gbps"]) == 2
        assert report["ffn_block"][f"native_pf{pf}_gbps"] > 0
    assert "native_gbps" not in row and row["torch_gbps"] > 0
    assert report["prefetch_default"] == before and kernels.prefetch() == before


def test_cpu_decode_takes_turns_at_prefetch_distances(tmp_path):
    """`engine.bench.cpu_decode`: whole CPU decode turns at each distance (abba), each turn's rate recorded,
    a median per distance, and the kernel's distance back afterwards."""
    from engine import kernels
    from engine.bench import cpu_decode

    before = kernels.prefetch()
    if before is None:
        pytest.skip(f"no native kernel: {kernels.status()}")
    assert cpu_decode.main(["--shape", "tiny-llama", "--layers", "2", "--prefetch", "0,512", "--turns", "4",
                            "--tokens", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "cpu_decode.json").read_text())
    assert [r["prefetch"] for r in report["rows"]] == [0, 512, 512, 0]
    assert all(r["tps"] > 0 for r in report["rows"]) and report["layers"] == 2
    assert kernels.prefetch() == before
