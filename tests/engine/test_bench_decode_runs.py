"""engine.bench.decode_runs and engine.bench.refine_contention, dry runs on the sim device."""

from __future__ import annotations

import json
from types import SimpleNamespace


def test_decode_runs_records_each_run_token_by_token(tmp_path):
    from engine.bench import decode_runs

    assert decode_runs.main(["--shape", "tiny-moe", "--budget", "2MiB", "--device", "sim", "--runs", "3",
                             "--tokens", "5", "--poll-s", "0.02", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_runs.json").read_text())["rows"]
    assert len(rows) == 3
    for r in rows:
        assert len(r["token_ms"]) == 4 and r["tps"] > 0 and r["kv_tokens"] > 0
        assert r["plan"]["tier"] >= 1 and isinstance(r["replans"], list)
    assert [r["nvml_poll_s"] for r in rows] == [None, 0.02, None]


def test_refine_contention_runs_each_mode_and_the_refinement_finishes(tmp_path):
    from engine.backends import torch_engine
    from engine.bench import refine_contention

    assert refine_contention.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--tokens", "4",
                                   "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "refine_contention.json").read_text())
    assert [r["mode"] for r in report["rows"]] == list(refine_contention.MODES)
    for r in report["rows"]:
        assert (r["refined_after_s"] is None) == (r["mode"] == "none")
    assert set(report["summary"]) == set(refine_contention.MODES)
    assert torch_engine.REFINE_YIELD            # put back after the no-yield mode


def test_decode_runs_take_turns_planning_from_two_profiles_in_one_engine(tmp_path):
    """`--profiles A,B`: the runs alternate between the two files' plans in one engine (a re-plan at each
    switch), so the second profile, whose CPU matmuls are 20x slower, gives its runs slower plans."""
    from engine.bench import decode_runs
    from engine.sharding.profile import sim_profile_dict
    from engine.sharding.profile_store import SCHEMA

    fast = sim_profile_dict()
    slow = sim_profile_dict()
    for table in slow["cpu"]["gemm"].values():
        for rows in table.values():
            for row in rows:
                row[1] /= 20
    files = []
    for name, entry in (("fast", fast), ("slow", slow)):
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"schema": SCHEMA, "profiles": {name: entry}}))
        files.append(str(f))
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--profiles", ",".join(files), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    rows = report["rows"]
    assert report["profiles"] == files and [r["profile"] for r in rows] == files * 2
    fast_ms = {r["plan"]["predicted_ms"] for r in rows if r["profile"] == files[0]}
    slow_ms = {r["plan"]["predicted_ms"] for r in rows if r["profile"] == files[1]}
    assert fast_ms and slow_ms and fast_ms.isdisjoint(slow_ms) and min(slow_ms) > max(fast_ms)


def test_decode_runs_take_turns_at_thread_counts_and_put_torch_back(tmp_path):
    """`--threads A,B`: the runs alternate between the CPU thread counts (each recorded with its run) under
    one plan, and torch's thread count is what it was afterwards."""
    import torch

    from engine.bench import decode_runs

    before = torch.get_num_threads()
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--threads", "2,1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["threads"] == [2, 1]
    assert [r["threads"] for r in report["rows"]] == [2, 1, 2, 1]
    assert len({r["plan"]["predicted_ms"] for r in report["rows"]}) == 1
    assert torch.get_num_threads() == before


def test_decode_runs_take_turns_at_placements_moved_to_the_cpu(tmp_path):
    """`--cpu-variants none,PATTERN`: the runs alternate between the planner's plan and the same plan with the
    matching sub-layers on the CPU (each run records which)."""
    from engine.bench import decode_runs

    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--cpu-variants", "none,layers.*.attn+head",
                             "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["cpu_variants"] == ["none", "layers.*.attn+head"]
    rows = report["rows"]
    assert [r["moved_to_cpu"] for r in rows] == ["none", "layers.*.attn+head"] * 2
    assert [r["plan"]["kind"] == "manual" for r in rows] == [False, True] * 2


def _recording(monkeypatch, name: str) -> list:
    """The values each call of `engine.kernels.<name>` passes, in order (the call still goes through)."""
    from engine import kernels

    seen, real = [], getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda n: seen.append(n) or real(n))
    return seen


def test_decode_runs_cross_spin_counts_with_placements(tmp_path, monkeypatch):
    """`--spins A,B` with `--cpu-variants`: each spin count runs a whole round of the variants (the two axes
    cross), and the pool's spin is the default again afterwards."""
    from engine import kernels
    from engine.bench import decode_runs

    seen = _recording(monkeypatch, "set_spin")
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--spins", "2000,20000", "--cpu-variants", "none,layers.*.attn",
                             "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_runs.json").read_text())["rows"]
    assert [(r["spin"], r["moved_to_cpu"]) for r in rows] == [
        (2000, "none"), (2000, "layers.*.attn"), (20000, "none"), (20000, "layers.*.attn")]
    assert seen[:4] == [2000, 2000, 20000, 20000] and seen[-1] == kernels.SPIN


def test_decode_runs_take_turns_at_prefetch_distances_and_put_the_default_back(tmp_path, monkeypatch):
    """`--prefetch-variants 0,512`: the runs take turns at the native matmuls' prefetch distance, each row
    records its own, and the default distance is in use again afterwards."""
    from engine import kernels
    from engine.bench import decode_runs

    seen = _recording(monkeypatch, "set_prefetch")
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--prefetch-variants", "0,512", "--order", "abba",
                             "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert [r["prefetch"] for r in report["rows"]] == [0, 512, 512, 0]
    assert report["prefetch_variants"] == [0, 512]
    assert seen[:4] == [0, 512, 512, 0] and seen[-1] == 512
    assert kernels.prefetch() in (None, 512)


def test_decode_runs_lease_profile_is_the_file_moved_to_the_probed_rates(tmp_path, monkeypatch):
    """`--profiles P,lease:P`: the second is P at the rates probed before the engine opens."""
    from engine.bench import decode_runs
    from engine.sharding.profile import sim_profile_dict
    from engine.sharding.profile_store import SCHEMA

    entry = sim_profile_dict()
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"schema": SCHEMA, "profiles": {"p": entry}}))
    probed = {"cpu_gemv_gbps": entry["link"]["cpu_gemv_gbps"] * 1.5, "cpu_gemv_with_copy_gbps": None,
              "h2d_gbps": None, "h2d_with_cpu_gbps": None}
    monkeypatch.setattr("engine.sharding.measure_link.probe_rates", lambda *a, **k: dict(probed))
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "2",
                             "--tokens", "4", "--profiles", f"{f},lease:{f}", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["probed_rates"] == probed
    assert [r["profile"] for r in report["rows"]] == [str(f), f"lease:{f}"]


def test_streamed_ffn_variants_name_ffns_the_plan_streams(tmp_path):
    """`streamed-ffn:N` becomes N of the FFNs the planner's one-token plan streams, evenly spaced."""
    from engine.bench.decode_runs import resolve_variant
    from engine.sharding.plan import Placement

    placement = {f"layers.{i}.ffn": Placement.STREAMED if i % 2 else Placement.CPU for i in range(12)}
    placement["layers.3.attn"] = Placement.STREAMED

    class PlanSet:
        def for_tokens(self, n):
            assert n == 1
            return SimpleNamespace(placement=placement)

    class Eng:
        planset = PlanSet()

    assert resolve_variant(Eng(), ("streamed-ffn:3", "head")) == ("layers.3.ffn", "layers.7.ffn", "layers.11.ffn", "head")
    assert resolve_variant(Eng(), ("streamed-ffn:9",)) == tuple(f"layers.{i}.ffn" for i in range(1, 12, 2))
    assert resolve_variant(Eng(), ("layers.*.attn",)) == ("layers.*.attn",)


def test_decode_runs_take_turns_with_split_plans(tmp_path):
    """`--split-variants off,on`: the runs alternate between the small-step tiers planned with the prompts'
    and apart (`TorchEngine.split_plans`), each run recording which."""
    from engine.bench import decode_runs

    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "4", "--split-variants", "off,on", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["split_variants"] == [False, True]
    assert [r["split_plans"] for r in report["rows"]] == [False, True, False, True]


def test_decode_runs_take_turns_with_the_graphs_host_io_off_and_on(tmp_path):
    from engine.bench import decode_runs

    assert decode_runs.main(["--shape", "tiny-moe", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "3", "--host-io-variants", "off,on", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert [r["graph_host_io"] for r in report["rows"]] == [False, True, False, True]
    assert report["host_io_variants"] == [False, True]


def test_decode_runs_in_abba_order_reverse_every_other_round(tmp_path):
    from engine.bench import decode_runs

    assert decode_runs.main(["--shape", "tiny-moe", "--budget", "2MiB", "--device", "sim", "--runs", "6",
                             "--tokens", "3", "--host-io-variants", "off,on", "--order", "abba", "--poll-s", "0.02",
                             "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "decode_runs.json").read_text())["rows"]
    assert [r["graph_host_io"] for r in rows] == [False, True, True, False, False, True]
    polled = [r["graph_host_io"] for r in rows if r["nvml_poll_s"]]
    assert polled.count(True) and polled.count(False)       # the poller beside both variants
    turn = decode_runs.turn_of("abba")
    assert [turn(i, 3) for i in range(9)] == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert [decode_runs.turn_of("cycle")(i, 3) for i in range(6)] == [0, 1, 2, 0, 1, 2]


def test_decode_runs_take_turns_issuing_coded_copies_from_their_own_thread_or_not(tmp_path, monkeypatch):
    """`--issuer-variants off,on`: the runs alternate (abba) between coded copies issued from the step's
    thread and from the accelerator's issuer thread, in one engine, and each run records which."""
    from engine.bench import decode_runs

    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1")
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_MIN", "0")
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "3", "--issuer-variants", "off,on", "--order", "abba",
                             "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["issuer_variants"] == [False, True]
    assert [r["issue_thread"] for r in report["rows"]] == [False, True, True, False]


def test_decode_runs_take_turns_with_the_ring_running_ahead_or_not(tmp_path, monkeypatch):
    """`--ring-ahead-variants off,on`: the runs alternate between coded copies waiting for their slot's
    compute before crossing and crossing into the ring ahead of it; each run records which, and the
    accelerator is left as the last run had it."""
    from engine.bench import decode_runs

    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE", "1")
    monkeypatch.setenv("SLIPSTREAM_TRANSFER_CODE_MIN", "0")
    seen = []
    from engine.sharding.device import Accelerator

    real = Accelerator.set_ring_ahead
    monkeypatch.setattr(Accelerator, "set_ring_ahead", lambda self, flag: (seen.append(flag), real(self, flag))[1])
    assert decode_runs.main(["--shape", "tiny-llama", "--budget", "2MiB", "--device", "sim", "--runs", "4",
                             "--tokens", "3", "--ring-ahead-variants", "off,on", "--order", "abba",
                             "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "decode_runs.json").read_text())
    assert report["ring_ahead_variants"] == [False, True]
    assert [r["ring_ahead"] for r in report["rows"]] == [False, True, True, False] == seen


def test_prefill_timeline_lists_each_prompts_steps_and_activations(tmp_path):
    from engine.bench import prefill_timeline

    assert prefill_timeline.main(["--shape", "tiny-llama", "--device", "sim", "--budgets", "2MiB,4MiB",
                                  "--runs", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "prefill_timeline.json").read_text())["rows"]
    assert [(r["budget"], r["tokens"]) for r in rows] == [("2MiB", 512), ("2MiB", 4096), ("4MiB", 512), ("4MiB", 4096)]
    for r in rows:
        steps = [s for s in r["spans"] if s["what"] == "executor.forward_batch"]
        assert sum(int(n) for s in steps for n in s["info"].removeprefix("tokens ").split("+")) == r["tokens"]
        assert r["ttft_ms"] >= sum(s["ms"] for s in steps) > 0
    lines = prefill_timeline._lines(rows[1]["spans"])
    assert any("forward_batch" in line for line in lines)
