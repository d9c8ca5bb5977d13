"""Partial results (resume, deadline) and the merge into results.json / results.md / plots."""

from __future__ import annotations

import json
import time

import pytest

from engine.bench.gpu_merge import load_parts, merge, table
from engine.bench.partials import Deadline, Partial, row_key

GiB = 1 << 30


def _row(system: str, budget: str, decode: float, **kw) -> dict:
    return {"system": system, "model": "llama3-8b", "budget": budget, "budget_bytes": int(budget[0]) * GiB,
            "peak_vram_bytes": int(budget[0]) * GiB, "prefill512_tps": 100.0, "prefill4096_tps": 200.0,
            "decode_tps": decode, "command": f"cmd {system}", **kw}


def test_partial_saves_every_row_and_resumes_from_a_prior_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    first = Partial(tmp_path / "call1", "llamacpp", machine={"gpu": "H200"})
    first.add(_row("llama.cpp-default", "2GiB", 5.0))
    first.state["learned_c"] = {"x": 1.0}
    first.save()
    again = Partial(tmp_path / "call3", "llamacpp", prior_dir=tmp_path / "call1", machine={"gpu": "H200"})
    assert again.has(row_key(_row("llama.cpp-default", "2GiB", 0))) and not again.has("nothing")
    assert again.state["learned_c"] == {"x": 1.0}
    again.add(_row("llama.cpp-default", "2GiB", 6.0))                       # same key: replaced
    again.add(_row("llama.cpp-default", "4GiB", 7.0))
    data = json.loads((tmp_path / "call3" / "part-llamacpp.json").read_text())
    assert [r["decode_tps"] for r in data["rows"]] == [6.0, 7.0] and len(data["machines"]) == 2
    (again.log_dir / "run.out").write_text("raw")
    assert again.pack_logs().name == "llamacpp-logs.tar.xz"


def test_deadline(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_BENCH_DEADLINE", raising=False)
    assert Deadline().allows(1e9)
    d = Deadline(time.time() + 100)
    assert d.allows(50) and not d.allows(200) and d.cap(300) <= 100 and d.cap(10) == 10
    monkeypatch.setenv("SLIPSTREAM_BENCH_DEADLINE", str(time.time() - 1))
    assert not Deadline().allows(0) and Deadline().cap(60) == 1.0


def test_merge_writes_results_with_bound_rows_sorted_and_a_table(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    s = Partial(out, "slipstream", machine={"gpu": "NVIDIA H200", "cpu": "Xeon"})
    s.add(_row("slipstream", "4GiB", 6.0, plan={"tiers": [{"tokens": 1, "plan": "dynamic"},
                                                          {"tokens": 4096, "plan": "gpu_only"}]},
               decode_batch4_tps=None, decode_batch_note="not supported yet (batching comes later)"))
    s.add(_row("slipstream", "2GiB", 4.0))
    s.meta["lease_probes"] = [{"at": "2026-11-29T19:50:00+00:00", "cpu_gemv_gbps": 81.5, "h2d_gbps": 55.1,
                               "steal_share": 0.02}]
    s.save()
    ll = Partial(out, "llamacpp")
    ll.add(_row("llama.cpp-tuned", "4GiB", 6.7, plan={"x": 33, "flags": ["-ngl", "33"]}, fits=True))
    ll.add(_row("llama.cpp-default", "4GiB", 5.7, plan={"x": 7, "flags": ["-ngl", "7"]}, fits=False))
    co = Partial(out, "corun")
    co.add({"system": "slipstream", "model": "llama3-8b", "budget": "auto", "scenario": "corun",
            "per_phase": [{"game_fps": 60.0, "model_tps": 30.0}, {"game_fps": 58.0, "model_tps": 4.0}],
            "game_ooms": 0, "game_oom_stall_s": 0.0, "card_over_cap_s": 0.0, "model_errors": 0, "cap_bytes": 24 * GiB,
            "timeline": {"game": [[0, 60, 5, 1, 1, 0]], "model_tps": [[0, 30]], "vram": [[0, 1, 1, 1]],
                         "budget_events": [[0, GiB, "first"]], "oom_events": []}})
    co.add({"system": "llama.cpp", "model": "llama3-8b", "budget": "fixed", "scenario": "corun",
            "note": "llama.cpp not available here"})
    assert set(load_parts([out])) == {"slipstream", "llamacpp", "corun"}
    res_dir = tmp_path / "results"
    assert merge([out], res_dir, say=lambda m: None) == 0
    result = json.loads((res_dir / "results.json").read_text())
    assert {"machine", "date", "rows", "corun", "notes"} <= set(result)
    keys = [(r["budget"], r["system"]) for r in result["rows"]]
    assert keys == [("2GiB", "slipstream"), ("2GiB", "bound"), ("4GiB", "slipstream"),
                    ("4GiB", "llama.cpp-default"), ("4GiB", "llama.cpp-tuned"), ("4GiB", "bound")]
    for r in result["rows"]:
        assert {"system", "model", "budget", "peak_vram_bytes", "prefill4096_tps", "decode_tps", "command"} <= set(r)
    md = (res_dir / "results.md").read_text()
    assert "| llama3-8b | 4GiB | llama.cpp-default | 4.00 | **no** |" in md
    assert "dynamic (decode) / gpu_only (tier 4096)" in md and "not available here" in md
    assert "| slipstream | auto | 60 / 58 | 30.0 / 4.0 | 0 (0.0) | 0.0 | 0 |" in md
    assert (res_dir / "results_decode.png").stat().st_size > 1000
    assert (res_dir / "results_ttft.png").stat().st_size > 1000
    assert (res_dir / "corun_timeline.png").stat().st_size > 1000
    assert table([]).count("\n") == 1
    assert "- slipstream: 2026-11-29T19:50 CPU 81.5 GB/s, host->GPU 55.1 GB/s, steal 0.02" in md
    assert result["parts"]["slipstream"]["lease_probes"][0]["cpu_gemv_gbps"] == 81.5
    assert result["parts"]["llamacpp"]["lease_probes"] is None and "- llamacpp:" not in md


def test_lease_probe_times_the_cpu_path_and_reads_steal_time():
    from engine.bench.gpu_common import lease_probe

    p = lease_probe(weight_mib=16, min_s=0.05)
    assert p["cpu_gemv_gbps"] > 0 and p["cpu_threads"] >= 1
    assert p["steal_share"] is None or 0 <= p["steal_share"] <= 1
    assert (p["h2d_gbps"] is None) == (not __import__("torch").cuda.is_available())


def test_ratios_compare_with_the_fastest_fitting_llamacpp_row_and_judge_the_targets():
    from engine.bench.gpu_merge import ratio_table, ratios

    rows = [_row("slipstream", "4GiB", 6.0, prefill4096_tps=9000.0, fits=True, budget_bytes=4 * GiB),
            _row("llama.cpp-default", "4GiB", 7.0, prefill4096_tps=300.0, fits=False),   # did not fit
            _row("llama.cpp-tuned", "4GiB", 5.0, prefill4096_tps=4000.0, fits=True),
            _row("bound", "4GiB", 10.0, prefill4096_tps=20000.0),
            _row("slipstream", "2GiB", 3.0, fits=False)]
    got = {(r["budget"], r["metric"], r["against"]): r for r in ratios(rows)}
    dec = got[("4GiB", "decode", "best llama.cpp")]
    assert dec["peer_system"] == "llama.cpp-tuned" and dec["ratio"] == 6.0 / 5.0
    assert dec["target"] == 1.5 and dec["met"] is False
    pre = got[("4GiB", "prefill 4096", "best llama.cpp")]
    assert pre["ratio"] == 9000.0 / 4000.0 and pre["met"] is True
    default = got[("4GiB", "prefill 4096", "llama.cpp-default")]
    assert default["peer"] is None and default["met"] is None          # the default row did not fit
    bound = got[("4GiB", "decode", "bound")]
    assert bound["ratio"] == 0.6 and bound["target"] == 0.75 and bound["met"] is False
    assert got[("4GiB", "peak VRAM within the budget", "budget")]["met"] is True
    small = got[("2GiB", "decode", "best llama.cpp")]
    assert small["peer"] is None and small["target"] is None            # no llama.cpp row, no target there
    assert got[("2GiB", "peak VRAM within the budget", "budget")]["met"] is False
    md = ratio_table(ratios(rows))
    assert "| llama3-8b | 4GiB | decode | 6.00 | best llama.cpp (llama.cpp-tuned) | 5.00 | 1.20x | at least 1.5x | **no** |" in md
    assert "| llama3-8b | 2GiB | decode | 3.00 | best llama.cpp | not run | - | reported | - |" in md


def test_engine_parts_run_one_shape_per_process():
    """`--part slipstream --models a,b` runs a child process per shape, each with its own --models."""
    from engine.bench.gpu_suite import child_argv

    argv = ["bench", "--gpu", "--part", "slipstream", "--models", "llama3-8b,qwen3-30b-a3b", "--out", "x"]
    assert child_argv(argv, "slipstream", "qwen3-30b-a3b") == [
        "--part", "slipstream", "--models", "qwen3-30b-a3b", "--out", "x"]
    assert child_argv(["--part=slipstream,corun", "--models=a,b", "--dry-run"], "corun") == [
        "--part", "corun", "--models=a,b", "--dry-run"]


def test_targets_beyond_the_bound_are_named():
    from engine.bench.gpu_merge import beyond_bound

    def row(metric, against, peer, target):
        return {"model": "m", "budget": "4GiB", "metric": metric, "against": against, "peer": peer,
                "target": target}

    rs = [row("decode", "best llama.cpp", 7.0, 1.5), row("decode", "bound", 11.0, 0.75),
          row("prefill 512", "llama.cpp-default", 300.0, 10.0), row("prefill 512", "bound", 2500.0, None),
          row("prefill 4096", "llama.cpp-default", 300.0, 10.0), row("prefill 4096", "bound", 16000.0, None)]
    text = beyond_bound(rs)
    assert "decode is 10.50 tokens/s, the bound 11.00" in text and "prefill 512 is 3000" in text
    assert "prefill 4096" not in text
    assert beyond_bound(rs[4:]) == ""
    # where Slipstream's row streamed coded weights, the bound it could reach is the coded one
    coded = rs + [row("prefill 512", "bound with coded transfers", 3600.0, None)]
    assert "prefill 512" not in beyond_bound(coded) and "decode is 10.50" in beyond_bound(coded)


def test_the_vl_part_runs_resumes_and_merges(tmp_path, monkeypatch):
    """`--part vl` (dry run: the tiny Qwen2.5-VL shape on the sim device, Slipstream only) writes a row per
    budget with the time to first token over the image prompt; a second call skips what is done; the merge
    puts the rows in results.json and a table of their own in results.md."""
    from engine.bench import gpu_suite

    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    argv = ["--part", "vl", "--dry-run", "--budgets", "2MiB", "--vl-systems", "slipstream", "--out", str(out)]
    assert gpu_suite.main(argv) == 0
    rows = json.loads((out / "part-vl.json").read_text())["rows"]
    assert len(rows) == 1 and not rows[0].get("error"), rows
    row = rows[0]
    assert (row["system"], row["model"], row["budget"]) == ("slipstream", "tiny-vl", "2MiB")
    assert row["ttft_s"] > 0 and row["new_tokens"] == 32 and row["image_tokens"] > 100
    assert row["prompt_tokens"] > row["image_tokens"] and row["vision_where"] in ("cpu", "gpu", "sim")
    assert gpu_suite.main(argv + ["--prior", str(out)]) == 0          # resumes: nothing run again
    again = json.loads((out / "part-vl.json").read_text())["rows"]
    assert again == rows
    assert merge([out], tmp_path / "res") == 0
    result = json.loads((tmp_path / "res" / "results.json").read_text())
    assert [r["model"] for r in result["vl"]] == ["tiny-vl"]
    assert "| tiny-vl | 2MiB | slipstream |" in (tmp_path / "res" / "results.md").read_text()


def test_vl_rows_fit_by_the_suite_rule():
    from engine.bench.vl_runs import row_for

    res = {"nvml_peak_bytes": 4 * GiB + 100, "ttft_s": 3.0, "decode_tps": 2.0}
    assert row_for("slipstream", "m", "4GiB", 4 * GiB, res, 500, 32, "c")["fits"] is False   # whole process
    assert row_for("accelerate", "m", "4GiB", 4 * GiB, res, 500, 8, "c")["fits"] is True     # + allowance
    assert row_for("accelerate", "m", "4GiB", 4 * GiB, {"error": "x"}, 500, 8, "c")["fits"] is None


def test_a_vl_run_cut_short_by_the_calls_end_is_left_for_a_later_call(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from engine.bench import vl_runs, vlm_bench

    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    part = Partial(tmp_path / "out", "vl")
    key = row_key({"system": "slipstream", "model": vl_runs.DRY_MODEL, "budget": "2MiB", "scenario": vl_runs.SCENARIO})
    limits = []

    def spawn(system, ns, limit, result):
        limits.append(limit)
        return dict(result)

    args = SimpleNamespace(dry_run=True)
    monkeypatch.setattr(vlm_bench, "spawn", lambda s, ns, limit: spawn(s, ns, limit, {"error": "no result within"}))
    vl_runs.run_vl(args, part, Deadline(time.time() + 120), "cmd", [("2MiB", 2 << 20)], 0, ("slipstream",))
    assert limits[-1] < vl_runs.LIMITS["slipstream"] and not part.has(key)       # cut by the call's end
    monkeypatch.setattr(vlm_bench, "spawn", lambda s, ns, limit: spawn(s, ns, limit, {"ttft_s": 1.0}))
    vl_runs.run_vl(args, part, Deadline(), "cmd", [("2MiB", 2 << 20)], 0, ("slipstream",))
    assert part.has(key) and len(part.rows) == 1 and part.rows[0]["ttft_s"] == 1.0
    vl_runs.run_vl(args, part, Deadline(), "cmd", [("2MiB", 2 << 20)], 0, ("slipstream",))
    assert len(limits) == 2                                                        # done: not run again


def test_weights_note_names_the_parts_whose_moe_rows_predate_the_spreading_weights():
    from engine.bench.gpu_merge import _weights_note

    moe_row = {"model": "qwen3-30b-a3b", "system": "x", "budget": "4GiB"}
    parts = {"slipstream": {"meta": {"weights": "random_std"}, "rows": [moe_row]},
             "llamacpp": {"meta": {"weights": "random_std"}, "rows": [moe_row]},
             "accelerate": {"meta": {}, "rows": [moe_row]},
             "corun": {"meta": {}, "rows": [{"model": "llama3-8b"}]}}
    note = _weights_note(parts)
    assert note.endswith("the qwen3-30b-a3b rows of accelerate (4GiB).")
    del parts["accelerate"]
    assert "Measured before" not in _weights_note(parts)


def test_rates_probe_measures_the_cpu_rate_and_copies_only_beside_a_gpu():
    from engine.bench.gpu_common import rates_probe

    p = rates_probe(weight_mib=16, copy_mib=4, min_s=0.02)
    assert p["cpu_gemv_gbps"] > 0 and p["at"]
    assert p["steal_share"] is None or 0 <= p["steal_share"] <= 1
    cuda = __import__("torch").cuda.is_available()
    for k in ("cpu_gemv_with_copy_gbps", "h2d_gbps", "h2d_with_cpu_gbps"):
        assert (p[k] is None) == (not cuda)


def test_a_slipstream_row_keeps_the_rates_probed_before_and_after_its_engine(tmp_path, monkeypatch):
    """`--part slipstream` (dry run: the tiny dense shape on the sim device) probes the machine's rates
    before opening the engine and after closing it, and every row of the run keeps both."""
    from engine.bench import gpu_suite

    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    assert gpu_suite.main(["--part", "slipstream", "--dry-run", "--models", "tiny-llama", "--budgets", "2MiB,4MiB",
                           "--out", str(out)]) == 0
    rows = json.loads((out / "part-slipstream.json").read_text())["rows"]
    assert [r["budget"] for r in rows] == ["2MiB", "4MiB"]
    for r in rows:
        before, after = r["lease_rates"]["before"], r["lease_rates"]["after"]
        assert before["cpu_gemv_gbps"] > 0 and after["cpu_gemv_gbps"] > 0 and before["at"] <= after["at"]


def test_a_budget_whose_run_fails_keeps_its_traceback_with_the_logs(tmp_path, monkeypatch):
    """A budget whose measurement raises keeps the rows before it, and its traceback beside the plans in the
    part's logs (not only the error's line on the console)."""
    from engine.bench import gpu_suite, slipstream_runs

    real = slipstream_runs.measure_budget

    def fails_at_4mib(eng, b, *args, **kwargs):
        if b == 4 << 20:
            raise RuntimeError("scratch for 1024-token steps: simulated")
        return real(eng, b, *args, **kwargs)

    monkeypatch.setattr(slipstream_runs, "measure_budget", fails_at_4mib)
    monkeypatch.setenv("SLIPSTREAM_BENCH_WORK", str(tmp_path / "work"))
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated"):
        gpu_suite.main(["--part", "slipstream", "--dry-run", "--models", "tiny-llama", "--budgets", "2MiB,4MiB",
                        "--out", str(out)])
    assert [r["budget"] for r in json.loads((out / "part-slipstream.json").read_text())["rows"]] == ["2MiB"]
    text = (tmp_path / "work" / "logs" / "slipstream" / "tiny-llama-4MiB-error.txt").read_text()
    assert "Traceback" in text and "fails_at_4mib" in text and "simulated" in text


def test_decode_is_also_set_beside_the_bound_at_the_rates_its_own_lease_showed(tmp_path):
    """The merge prices the decode bound of a Slipstream row at the mean of its probed CPU and PCIe rates
    (the profile's elsewhere) and judges the 0.75x target against it too; a row whose probes lack the
    copy rates (no GPU) gets no such line."""
    from engine.bench.bound import Rates, decode_bound_tps, shape_bytes
    from engine.bench.gguf_shapes import gguf_shape
    from engine.bench.gpu_merge import CODED_BOUND, LEASE_BOUND, _profile, ratio_table, ratios
    from engine.bench.scenarios import SCENARIOS

    def probe(cpu, cpu_copy, h2d, h2d_cpu):
        return {"cpu_gemv_gbps": cpu, "cpu_gemv_with_copy_gbps": cpu_copy, "h2d_gbps": h2d,
                "h2d_with_cpu_gbps": h2d_cpu}

    slow = {"before": probe(60.0, 50.0, 54.0, 50.0), "after": probe(70.0, 60.0, 56.0, 52.0)}
    out = tmp_path / "out"
    s = Partial(out, "slipstream", machine={"gpu": "NVIDIA H200"})
    slow["before"]["at"], slow["after"]["at"] = "2026-11-30T16:36:10+00:00", "2026-11-30T16:38:40+00:00"
    s.add(_row("slipstream", "4GiB", 8.0, fits=True, lease_rates=slow, call="call CG: at the defaults",
               decode_runs_detail=[{"tps": 8.0, "steal_share": 0.01}, {"tps": 8.1, "steal_share": 0.03}]))
    s.add(_row("slipstream", "2GiB", 6.0, fits=True,
               lease_rates={"before": probe(60.0, None, None, None)}))
    s.save()
    assert merge([out], tmp_path / "res", say=lambda m: None) == 0
    result = json.loads((tmp_path / "res" / "results.json").read_text())
    mine = {r["budget"]: r for r in result["rows"] if r["system"] == "slipstream"}
    bound = {r["budget"]: r for r in result["rows"] if r["system"] == "bound"}
    base = Rates.from_profile(_profile({})[0])
    rates = Rates(cpu_gbps=55.0, pcie_gbps=51.0, cpu_alone_gbps=65.0, pcie_alone_gbps=55.0,
                  hbm_gbps=base.hbm_gbps, gpu_tflops=base.gpu_tflops, cpu_tflops=base.cpu_tflops)
    want = decode_bound_tps(shape_bytes(gguf_shape(SCENARIOS["llama3-8b"].gguf_shape)), 4 * GiB, rates)
    assert abs(mine["4GiB"]["bound_lease_decode_tps"] - want) < 1e-9
    assert want < bound["4GiB"]["decode_tps"]                    # a slower lease than the profile's: a lower bound
    assert "bound_lease_decode_tps" not in mine["2GiB"]
    got = {(r["budget"], r["against"]): r for r in result["ratios"] if r["metric"] == "decode"}
    lease = got[("4GiB", LEASE_BOUND)]
    assert lease["ratio"] == 8.0 / want and lease["target"] == 0.75 and lease["met"] == (8.0 / want >= 0.75)
    assert got[("4GiB", "bound")]["ratio"] == 8.0 / bound["4GiB"]["decode_tps"]
    assert ("2GiB", LEASE_BOUND) not in got
    assert not any(a == CODED_BOUND for _, a in got)            # (no row streamed coded weights)
    assert f"| llama3-8b | 4GiB | decode | 8.00 | {LEASE_BOUND} |" in ratio_table(ratios(result["rows"]))
    md = (tmp_path / "res" / "results.md").read_text()
    assert ("- llama3-8b (4GiB), 2026-11-30: before 16:36 CPU 60.0 / 50.0, host->GPU 54.0 / 50.0, steal None; "
            "after 16:38 CPU 70.0 / 60.0, host->GPU 56.0 / 52.0, steal None; decode runs' CPU steal 4GiB 2.0%; "
            "call CG: at the defaults\n") in md


def test_rows_that_streamed_coded_weights_are_also_set_beside_the_coded_bound(tmp_path):
    from engine.bench.gpu_merge import CODED_BOUND

    out = tmp_path / "out"
    s = Partial(out, "slipstream", machine={"gpu": "NVIDIA H200"})
    s.add(_row("slipstream", "4GiB", 8.0, fits=True,
               transfer_coding={"transfer_coded_sublayers": 64, "transfer_coded_ratio": 0.753}))
    s.add(_row("slipstream", "2GiB", 6.0, fits=True, transfer_coding={"transfer_coded_sublayers": 0}))
    s.save()
    assert merge([out], tmp_path / "res", say=lambda m: None) == 0
    result = json.loads((tmp_path / "res" / "results.json").read_text())
    bound = {r["budget"]: r for r in result["rows"] if r["system"] == "bound"}
    coded = {(r["budget"], r["metric"]): r for r in result["ratios"] if r["against"] == CODED_BOUND}
    assert coded[("4GiB", "decode")]["peer"] == bound["4GiB"]["decode_tps_coded"] > bound["4GiB"]["decode_tps"]
    assert coded[("4GiB", "decode")]["target"] is None
    assert not any(b == "2GiB" for b, _ in coded)
