"""`engine.bench.cpu_call_phases`: the attention and FFN layer calls timed phase by phase beside plain
matmuls of the same weights (a tiny shape here; the GPU machine's host runs Llama-3-8B's)."""

from __future__ import annotations

import json

import pytest

from engine import kernels
from engine.bench import cpu_call_phases


def test_phases_add_up_to_each_call_and_the_report_is_written(tmp_path):
    if not kernels.set_phase_timing(False) or not kernels.attention_ready():
        pytest.skip("no native CPU library with the vector attention kernel here")
    assert cpu_call_phases.main(["--shape", "tiny", "--reps", "4", "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "cpu_call_phases.json").read_text())
    res = rep["results"]
    assert rep["command"].startswith("python -m engine.bench.cpu_call_phases")
    for call, phases in (("attention call", kernels.ATTENTION_PHASES), ("FFN call", kernels.FFN_PHASES)):
        got = res[call]["phases_ms"]
        assert list(got) == list(phases) and all(ms > 0 for ms in got.values())
        assert sum(got.values()) <= res[call]["ms"] * 1.05     # the phases sit inside the call
    dims = cpu_call_phases.TINY
    assert res["q/k/v matmul"]["bytes"] == 2 * (dims["num_heads"] + 2 * dims["num_kv_heads"]) * dims["head_dim"] \
        * dims["hidden_size"]
    assert kernels.read_phases()["attention_calls"] == 0          # timing is off again: nothing counted


def test_timing_is_off_by_default_and_counts_only_while_on():
    if not kernels.set_phase_timing(False) or not kernels.attention_ready():
        pytest.skip("no native CPU library with the vector attention kernel here")
    import torch

    w = cpu_call_phases.layer_weights(cpu_call_phases.TINY, 1)[0]
    x = torch.randn(1, cpu_call_phases.TINY["hidden_size"]).to(torch.bfloat16)
    kernels.read_phases()
    assert kernels.ffn_layer(x, w, 1e-5) is not None
    assert kernels.read_phases()["ffn_calls"] == 0
    kernels.set_phase_timing(True)
    try:
        kernels.ffn_layer(x, w, 1e-5)
        kernels.ffn_layer(x, w, 1e-5)
        assert kernels.read_phases()["ffn_calls"] == 2
    finally:
        kernels.set_phase_timing(False)
