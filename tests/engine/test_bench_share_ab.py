"""engine.bench.share_ab, a dry run on the sim device."""

from __future__ import annotations

import json

import pytest


def test_share_ab_takes_turns_and_reports_medians(tmp_path):
    from engine.bench import share_ab

    assert share_ab.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--variants", "on,off,48",
                          "--rounds", "2", "--parts", "prefill,decode", "--host-times", "--cpu-part-rows", "16,64",
                          "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "share_ab.json").read_text())
    assert [r["variant"] for r in report["rounds"]] == ["true", "false", 48, 48, "false", "true"]
    for r in report["rounds"]:
        assert r["prefill512_tps"] > 0 and r["decode_tps"] > 0 and "batch4_tps" not in r
        assert set(r["shares"]) and all(v in (0, 48) for v in r["shares"].values())
    assert [m["variant"] for m in report["medians"]] == ["true", "false", 48]
    assert all(r["host_ms"] and all(n > 0 and ms >= 0 for n, ms in r["host_ms"].values()) for r in report["rounds"])
    assert [c["rows"] for c in report["cpu_part"]] == [16, 64] and all(c["ms"] > 0 for c in report["cpu_part"])
    assert "command" in report and "machine" in report


@pytest.mark.parametrize("bad", [["--variants", "maybe"], ["--variants", "-3"], ["--parts", "train"]])
def test_share_ab_refuses_bad_arguments(bad):
    from engine.bench import share_ab

    with pytest.raises(SystemExit):
        share_ab.main(["--device", "sim", *bad])


def test_share_ab_sets_placements_beside_each_other_and_times_the_batches(tmp_path):
    from engine.bench import share_ab

    assert share_ab.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--moves",
                          "none;layers.*.attn+head", "--rounds", "2", "--parts", "decode,batch", "--host-times",
                          "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "share_ab.json").read_text())
    assert [r["variant"] for r in report["rounds"]] == ["none", "layers.*.attn+head", "layers.*.attn+head", "none"]
    for r in report["rounds"]:
        assert r["decode_tps"] > 0 and r["batch4_tps"] > 0 and r["batch16_tps"] > 0
        assert all(n > 0 for n, _ms in r["batch4_host_ms"].values())
    moved = [r for r in report["rounds"] if r["variant"] != "none"]
    assert all("cpu/attn" in r["batch16_host_ms"] and "cpu/head" in r["batch16_host_ms"] for r in moved)


def test_share_ab_times_the_native_layer_calls_phase_by_phase(tmp_path):
    from engine import kernels
    from engine.bench import share_ab

    if kernels._load() is None:
        pytest.skip(f"no native kernel: {kernels.status()}")
    assert share_ab.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--moves", "none",
                          "--rounds", "1", "--parts", "decode,batch", "--phases", "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "share_ab.json").read_text())["rounds"][0]
    # (the shape is bf16; where the CPU has AMX its matmuls of more than kernels.max_rows rows, 4 there, are
    # PyTorch's, so 16 streams' layers take the tensor path, all but the steps where few streams are left)
    import torch

    native16 = kernels.max_rows(torch.bfloat16) >= 16
    for key in ("decode_phases", "batch4_phases", "batch16_phases"):
        ph = row[key]
        # (16 streams' attention takes the tensor path: more rows than the native attention call takes)
        if key != "batch16_phases" or native16:
            assert ph["ffn"]["calls"] > 0 and (ph["attention"]["calls"] > 0 or key == "batch16_phases")
        for part, phases in (("ffn", kernels.FFN_PHASES), ("attention", kernels.ATTENTION_PHASES)):
            if ph[part]["calls"] == 0:
                assert set(ph[part]) == {"calls"}        # (no call timed, no phase reported)
            else:
                assert set(ph[part]) == {"calls", *phases} and all(v >= 0 for v in ph[part].values())
