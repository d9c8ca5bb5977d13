"""Co-run pieces without a GPU: the simulated card, the stand-in's phases, the per-phase summary."""

from __future__ import annotations

import json
import os

from engine.bench.corun import _REP, CorunConfig, summarize
from engine.bench.game_standin import parse_phases
from engine.bench.simcard import SimCard
from monitor import BudgetPolicy, Monitor

MiB = 1 << 20


def test_simcard_sums_live_processes_and_feeds_the_monitor_with_a_capped_total(tmp_path):
    card = SimCard(tmp_path, total=64 * MiB)
    card.set_own(5 * MiB, "me")
    (tmp_path / "999999999").write_text(f"{40 * MiB} gone")          # a dead pid does not count
    assert card.nvmlDeviceGetMemoryInfo(0).used == 5 * MiB
    assert [p.pid for p in card.nvmlDeviceGetComputeRunningProcesses(0)] == [os.getpid()]
    mon = Monitor(policy=BudgetPolicy(reserve=MiB, slack=0, hysteresis=MiB, total_cap=32 * MiB), nvml=card)
    mon.sample_once()
    assert mon.last_event().budget == 32 * MiB - MiB                   # our own use is not "others"
    card.clear_own()
    assert card.nvmlDeviceGetMemoryInfo(0).used == 0


def test_parse_phases():
    assert parse_phases("6GiB:20,20GiB:25.5") == [(6 << 30, 20.0), (20 << 30, 25.5)]


def test_summarize_splits_the_timeline_by_phase(tmp_path):
    t0 = 1000.0
    game = [{"event": "start", "t": t0}]
    game += [{"t": t0 + i, "phase": 0 if i < 3 else 1, "fps": 60.0 if i < 3 else 40.0, "frame_ms_p50": 5.0,
              "frame_ms_p99": 9.0, "working_set": 1, "card_used": 2, "ooms": 0} for i in range(1, 6)]
    game += [{"event": "oom", "t": t0 + 4.5, "kind": "simulated (card cap)"},
             {"event": "end", "t": t0 + 6, "ooms": 3, "oom_stall_s": 0.4, "frames": 300, "final_working_set": 1}]
    (tmp_path / "game.jsonl").write_text("\n".join(json.dumps(g) for g in game))
    model = [{"event": "budget", "t": t0 - 1, "budget": 8 * MiB, "reason": "first sample"}]
    model += [{"t": t0 + i, "tokens": 10 if i < 3 else 2, "window_s": 0.5} for i in range(1, 6)]
    model += [{"event": "end", "t": t0 + 6, "tokens": 40}]
    (tmp_path / "model.jsonl").write_text("\n".join(json.dumps(m) for m in model))
    cfg = CorunConfig(cap="16MiB", phases="3MiB:3,12MiB:3")
    s = summarize("slipstream", cfg, tmp_path, {"command": "x", "vram": []})
    assert s["game_ooms"] == 3 and s["game_oom_stall_s"] == 0.4 and s["model_errors"] == 0
    p0, p1 = s["per_phase"]
    assert p0["game_fps"] == 60.0 and p0["model_tps"] == 20.0
    assert p1["game_fps"] == 40.0 and p1["model_tps"] == 4.0
    assert s["timeline"]["oom_events"] == [[4.5, "simulated (card cap)"]]
    assert s["timeline"]["budget_events"][0][1] == 8 * MiB


def test_llama_bench_progress_lines_count_repetitions_not_the_warm_up():
    assert _REP.search("llama-bench: benchmark 1/1: generation run 7/100000")
    assert not _REP.search("llama-bench: benchmark 1/1: warmup generation run")
    assert not _REP.search("llama-bench: benchmark 1/1: prompt run 1/1")


def test_the_stand_in_counts_out_of_memory_against_the_cap_when_another_process_holds_the_card(tmp_path):
    from engine.bench import game_standin

    card = SimCard(tmp_path / "card", total=8 * MiB)
    (tmp_path / "card" / str(os.getppid())).write_text(f"{6 * MiB} model")   # a live process holding 6 MiB
    log = tmp_path / "game.jsonl"
    summary = game_standin.run(_stand_in_args(tmp_path, log))
    assert summary["ooms"] > 0 and summary["oom_stall_s"] > 0
    assert summary["final_working_set"] <= 2 * MiB            # it never went past the cap
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e.get("event") == "oom" and e["kind"] == "simulated (card cap)" for e in events)
    assert card.nvmlDeviceGetMemoryInfo(0).used == 6 * MiB        # the stand-in let go of its own


def _stand_in_args(tmp_path, log):
    import argparse

    return argparse.Namespace(cap="8MiB", phases="1MiB:0.3,4MiB:0.6", load_rate_bytes=64 * MiB, chunk="256KiB",
                              fps=100.0, matmuls=0, size=8, touch="0", log=str(log), ready_file=None,
                              go_file=None, max_wait_s=1.0, sim_dir=str(tmp_path / "card"), sim_frame_ms=1.0,
                              sim_context="0")
