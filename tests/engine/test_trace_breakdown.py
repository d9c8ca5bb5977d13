"""engine.bench.trace_breakdown on a hand-made trace: per-kind times, time outside PyTorch ops, busy shares."""

import gzip
import json

import pytest

from engine.bench import trace_breakdown as tb


def _x(name, ts, dur, cat, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "pid": 1, "args": args}


def _trace():
    return [
        _x("layers.0.attn:resident", 0, 100, "user_annotation"),
        _x("aten::linear", 10, 30, "cpu_op"),
        _x("aten::mm", 12, 20, "cpu_op"),                     # nested in linear: not counted again
        _x("aten::add", 50, 10, "cpu_op"),
        _x("cudaLaunchKernel", 14, 3, "cuda_runtime"),
        _x("cudaLaunchKernel", 52, 3, "cuda_runtime"),
        _x("cudaLaunchKernel", 60, 3, "cuda_runtime", tid=2),  # another thread's launch
        _x("layers.0.ffn:cpu", 100, 400, "user_annotation"),
        _x("aten::silu", 120, 40, "cpu_op"),
        _x("layers.1.ffn:cpu", 500, 200, "user_annotation"),
        _x("Memcpy HtoD (Pinned -> Device)", 300, 300, "gpu_memcpy", tid=7, bytes=3_000_000),
        _x("some_kernel", 20, 50, "kernel", tid=7),
    ]


def test_breakdown_by_kind_and_busy_shares(tmp_path, capsys):
    r = tb.breakdown(_trace())
    attn, ffn = r["kinds"]["resident/attn"], r["kinds"]["cpu/ffn"]
    assert (attn["n"], attn["us"], attn["outside_us"]) == (1, 100, 60)     # linear 30 + add 10 inside
    assert (ffn["n"], ffn["us"], ffn["outside_us"]) == (2, 600, 560)
    assert (sum(attn["calls"].values()), attn["launches"], ffn["launches"]) == (2, 2, 0)
    b = r["busy"]
    assert b["span_ms"] == pytest.approx(0.7)
    assert b["copies"] == pytest.approx(300 / 700)
    assert b["cpu_sublayers"] == pytest.approx(600 / 700)
    assert b["copies_and_cpu"] == pytest.approx(300 / 700)
    assert b["gpu_kernels"] == pytest.approx(50 / 700)
    assert b["none"] == pytest.approx(50 / 700)                              # 0-20 and 70-100
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    assert tb.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| cpu/ffn | 2 | 0.30 | 0.28 | 0 / 0 |" in out and "| resident/attn | 1 | 0.10 | 0.06 | 2 / 2 |" in out and "weight copies 43%" in out and "| 10.0 |" in out


def test_a_trace_without_sub_layer_ranges_is_refused():
    with pytest.raises(SystemExit, match="no sub-layer ranges"):
        tb.breakdown([_x("aten::add", 0, 1, "cpu_op")])
