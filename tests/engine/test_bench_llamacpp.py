"""llama.cpp baseline logic without llama.cpp: output parsing, configurations, the largest-that-fits search."""

from __future__ import annotations

import itertools
import json

import pytest

from engine.bench import llamacpp_plan as lp
from engine.bench.gguf_shapes import gguf_shape
from engine.bench.prepare_carry import keep_member

LLAMA = gguf_shape("llama3-8b")
MOE = gguf_shape("qwen3-30b-a3b", 24)
GB = 1e9


def _record(n_prompt: int, n_gen: int, ts: float, ngl: int = 4) -> dict:
    return {"build_commit": "abc", "model_size": 16060522496, "n_batch": 2048, "n_ubatch": 512, "n_threads": 16,
            "n_gpu_layers": ngl, "n_prompt": n_prompt, "n_gen": n_gen, "avg_ts": ts, "stddev_ts": 0.0,
            "samples_ts": [ts]}


def test_parse_llama_bench_jsonl_and_json_and_a_cut_short_run():
    recs = [_record(512, 0, 316.2), _record(4096, 0, 324.5), _record(0, 32, 5.7)]
    jsonl = "\n".join(json.dumps(r) for r in recs)
    for text in (jsonl, json.dumps(recs, indent=2)):
        res = lp.parse_llama_bench(text)
        assert res["pp512"] == 316.2 and res["pp4096"] == 324.5 and res["tg32"] == 5.7
        assert len(res["records"]) == 3
    cut = "[\n" + json.dumps(recs[0]) + ",\n" + json.dumps(recs[1])[:40]       # killed mid-output
    assert lp.parse_llama_bench(cut) == {"records": lp.parse_llama_bench(cut)["records"], "pp512": 316.2}
    assert lp.parse_llama_bench("ggml_cuda_init: found 1 CUDA devices\n") == {"records": []}


def test_parse_batched_bench_jsonl():
    line = ('{"n_kv_max": 9216, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1, "is_pp_shared": 0, '
            '"n_gpu_layers": 4, "n_threads": 16, "n_threads_batch": 16, "pp": 512, "tg": 32, "pl": %d, '
            '"n_kv": 2176, "t_pp": 6.1, "speed_pp": 335.0, "t_tg": 4.2, "speed_tg": %s, "t": 10.3, "speed": 210.0}')
    res = lp.parse_batched_bench("main: n_kv_max = 9216\n" + line % (4, "30.5") + "\n" + line % (16, "98.0"))
    assert res["tg_b4"] == 30.5 and res["tg_b16"] == 98.0 and len(res["records"]) == 2


def test_variant_args_dense_and_moe():
    assert lp.variant_args(LLAMA, lp.DEFAULT, 7) == ["-ngl", "7"]
    attn = lp.TUNED[0]
    assert attn.mode == "attn" and attn.flags[:2] == ("-lm", "none")
    assert lp.variant_args(LLAMA, attn, 10)[-4:] == ["-ngl", "10", "-ot", "ffn_.*=CPU"]
    full = lp.variant_args(LLAMA, attn, 33)                           # all attention + output, FFNs on CPU
    assert full[-4:] == ["-ngl", "33", "-ot", "ffn_.*=CPU"]
    some = lp.variant_args(LLAMA, attn, 33 + 5)                       # plus the FFNs of layers 0-4
    assert some[-3:-1] == ["99", "-ot"] and some[-1].startswith(r"blk\.(5|6|") and some[-1].endswith(r"|31)\.ffn_.*=CPU")
    assert lp.variant_args(LLAMA, attn, lp.x_max(LLAMA, "attn"))[-2:] == ["-ngl", "99"]
    assert lp.variant_args(MOE, attn, 12)[-4:] == ["-ngl", "12", "--n-cpu-moe", "24"]
    assert lp.variant_args(MOE, attn, 25 + 4)[-4:] == ["-ngl", "99", "--n-cpu-moe", "20"]


@pytest.mark.parametrize("shape,mode", [(LLAMA, "ngl"), (LLAMA, "attn"), (MOE, "ngl"), (MOE, "attn")])
def test_offloaded_bytes_grow_with_x(shape, mode):
    vals = [lp.offloaded_bytes(shape, mode, x) for x in range(lp.x_max(shape, mode) + 1)]
    assert vals[0] == 0 and all(b > a for a, b in itertools.pairwise(vals))
    wb = shape.weight_bytes()
    total = shape.layers * wb["layer"] + wb["output"]
    assert vals[-1] == pytest.approx(total + shape.layers * lp.kv_bytes_per_layer(shape, 4096), rel=1e-6)


def _fake_measure(true_c: float, shape, mode, calls: list):
    def measure(x: int) -> dict:
        calls.append(x)
        return {"peak": true_c + lp.offloaded_bytes(shape, mode, x), "x": x}
    return measure


def test_search_finds_the_largest_fitting_ngl_with_a_good_prior_in_one_run():
    calls: list[int] = []
    limit = 4.3 * GB + 0.5 * GB
    res = lp.search_fit(LLAMA, "ngl", limit, _fake_measure(1.6 * GB, LLAMA, "ngl", calls), c_prior=1.6 * GB)
    assert res.x == calls[0] and len(calls) == 1
    assert res.best["peak"] <= limit < 1.6 * GB + lp.offloaded_bytes(LLAMA, "ngl", res.x + 1)
    assert res.learned_c == pytest.approx(1.6 * GB)


def test_search_steps_down_when_the_prior_was_too_optimistic():
    calls: list[int] = []
    limit = 4.8 * GB
    res = lp.search_fit(LLAMA, "ngl", limit, _fake_measure(2.5 * GB, LLAMA, "ngl", calls), c_prior=1.0 * GB)
    assert len(calls) == 2 and calls[1] < calls[0]
    assert res.x == calls[1] and res.best["peak"] <= limit
    assert 2.5 * GB + lp.offloaded_bytes(LLAMA, "ngl", res.x + 1) > limit


def test_search_steps_up_when_the_prior_was_too_pessimistic():
    calls: list[int] = []
    limit = 8.6 * GB
    res = lp.search_fit(LLAMA, "attn", limit, _fake_measure(1.5 * GB, LLAMA, "attn", calls), c_prior=3.0 * GB)
    assert len(calls) == 2 and calls[1] > calls[0] and res.x == calls[1]
    assert 1.5 * GB + lp.offloaded_bytes(LLAMA, "attn", res.x + 1) > limit


def test_search_reports_when_nothing_fits_and_stops_on_errors():
    calls: list[int] = []
    res = lp.search_fit(LLAMA, "ngl", 2.0 * GB, _fake_measure(2.9 * GB, LLAMA, "ngl", calls), c_prior=3.2 * GB)
    assert res.x is None and calls == [0] and "no configuration" in res.note
    res = lp.search_fit(LLAMA, "ngl", 9 * GB, lambda x: {"error": "exit status 1: CUDA error"}, 1.6 * GB)
    assert res.x is None and "CUDA error" in res.note


def test_the_stripped_source_keeps_what_the_build_needs():
    assert keep_member("ggml/src/ggml-cuda/mmq.cu")
    assert keep_member("tools/llama-bench/llama-bench.cpp") and keep_member("tools/batched-bench/CMakeLists.txt")
    assert keep_member("vendor/miniaudio/miniaudio.h") and keep_member("models/ggml-vocab-qwen2.gguf")
    assert not keep_member("ggml/src/ggml-vulkan/ggml-vulkan.cpp") and not keep_member("tools/server/server.cpp")
    assert not keep_member("docs/build.md") and not keep_member("models/ggml-vocab-gpt-2.gguf")
    assert not keep_member("ggml/README.md")


def test_search_stops_without_a_verdict_when_a_run_is_cut_by_the_time_limit():
    calls: list[int] = []

    def measure(x: int) -> dict:
        calls.append(x)
        return {"peak": 3 * GB, "error": "timed out after 40 s", "abort": True}

    res = lp.search_fit(LLAMA, "ngl", 9 * GB, measure, c_prior=1.6 * GB)
    assert res.aborted and res.x is None and len(calls) == 1 and not res.runs


def test_a_rows_note_names_the_prefill_lengths_its_runs_left_out():
    from engine.bench.llamacpp_runs import runs_note_for

    assert runs_note_for((512, 4096)) == ""
    assert "-p 512 " in runs_note_for((512,)) and "no 4096-token prefill" in runs_note_for((512,))
    only_long = runs_note_for((4096,))
    assert "-p 4096 " in only_long and "no 512-token prefill" in only_long and "no 4096" not in only_long


def test_llama_bench_averages_the_runs_asked_for_and_the_note_says_so(tmp_path):
    from engine.bench.llamacpp_runs import LlamaCppRunner, runs_note_for

    runner = LlamaCppRunner(tmp_path, tmp_path / "m.gguf", None, 16, tmp_path, None, reps=3)
    argv = runner.bench_argv(["-ngl", "7"])
    assert argv[argv.index("-r") + 1] == "3"
    once = LlamaCppRunner(tmp_path, tmp_path / "m.gguf", None, 16, tmp_path, None).bench_argv([])
    assert once[once.index("-r") + 1] == "1"
    note = runs_note_for((512, 4096), 3)
    assert "-r 3" in note and "the mean of 3 runs" in note
    assert "-r 3" in runs_note_for((512,), 3) and "no 4096-token prefill" in runs_note_for((512,), 3)
