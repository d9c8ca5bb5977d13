"""The recorded traces replayed through the Monitor: detection, the budget's path, NVML's failures."""

from __future__ import annotations

import json

from monitor import NO_GPU, BudgetPolicy
from monitor.nvml import Nvml
from tests.monitor.helpers import WORKER_PID, GiB, room, run_trace, vram_of

GAME = 4242


def drops(rep):
    return [e for e in rep.events if e.previous is not None and e.budget is not None and e.budget < e.previous]


def rises(rep):
    return [e for e in rep.events if e.previous is not None and e.budget is not None and e.budget > e.previous]


def test_budget_never_above_the_room_nor_negative_in_any_trace():
    for name in ("game_launch", "level_load", "alt_tab", "game_exit", "two_gpus"):
        rep = run_trace(name)
        for s in rep.snaps:
            assert s.ok and 0 <= s.budget <= room(s), (name, s.time)


def test_game_launch_is_seen_and_every_growth_drops_the_budget_at_its_own_sample():
    rep = run_trace("game_launch")
    appear = rep.first(lambda s: vram_of(s, GAME) is not None)
    assert not any(s.gaming for s in rep.snaps[:appear]) and all(s.gaming for s in rep.snaps[appear:])
    game = next(p for p in rep.snaps[appear].processes if p.pid == GAME)
    assert game.is_game and game.reason == "in a Steam game folder" and game.kinds == {"graphics"}
    assert game.name == "Cyberpunk2077.exe" and game.exe.endswith("Cyberpunk2077.exe")
    worker = next(p for p in rep.snaps[0].processes if p.pid == WORKER_PID)
    assert worker.is_own and not worker.is_game
    for i in range(1, len(rep.snaps)):       # the game grew -> the budget is below the new room right away
        if (vram_of(rep.snaps[i], GAME) or 0) > (vram_of(rep.snaps[i - 1], GAME) or 0):
            assert rep.snaps[i].budget < rep.snaps[i - 1].budget
    reasons = [e.reason for e in drops(rep)]
    assert reasons[-1] == "Cyberpunk2077.exe grew to 7.0 GiB" and reasons[0].startswith("Cyberpunk2077.exe started")
    assert not rises(rep)


def test_level_load_spikes_do_not_thrash():
    rep = run_trace("level_load")
    assert len(drops(rep)) == 1 and len(rises(rep)) == 1
    first_spike = rep.first(lambda s: vram_of(s, GAME) == 10 * GiB)
    assert rep.snaps[first_spike].budget < rep.snaps[first_spike - 1].budget
    last_spike = max(i for i, s in enumerate(rep.snaps) if vram_of(s, GAME) == 10 * GiB)
    assert rises(rep)[0].time >= rep.snaps[last_spike].time + 3.0 - 1e-6
    assert "Cyberpunk2077.exe grew to 10.0 GiB" == drops(rep)[0].reason


def test_short_alt_tab_changes_nothing_and_a_long_one_gives_back_then_takes_at_once():
    rep = run_trace("alt_tab")
    short_end = rep.index_at(7.0)
    assert [e for e in rep.events if e.time < 7.0] == rep.events[:1]
    assert all(s.budget == rep.snaps[0].budget for s in rep.snaps[:short_end])
    leave = rep.index_at(7.0)
    back = rep.first(lambda s: s.time > 7.0 and vram_of(s, GAME) == 8 * GiB)
    up = rises(rep)
    assert len(up) == 1 and up[0].time >= rep.snaps[leave].time + 3.0 - 1e-6
    assert rep.snaps[back].budget < rep.snaps[back - 1].budget      # the player is back: budget falls at once
    assert rep.snaps[back].budget <= room(rep.snaps[back])
    assert all(s.gaming for s in rep.snaps)                           # alt-tabbed is still gaming


def test_game_exit_ends_gaming_at_once_and_gives_the_room_back_after_the_hold():
    rep = run_trace("game_exit")
    gone = rep.first(lambda s: vram_of(s, GAME) is None)
    assert rep.snaps[gone - 1].gaming and not rep.snaps[gone].gaming
    up = rises(rep)
    assert len(up) == 1 and up[0].reason.startswith("EldenRing.exe exited")
    assert up[0].time >= rep.snaps[gone].time + 3.0 - 1e-6
    assert rep.snaps[-1].budget == room(rep.snaps[-1]) - BudgetPolicy().slack


def test_pause_while_gaming_over_a_trace():
    rep = run_trace("game_exit", policy=BudgetPolicy(mode="pause_when_gaming"))
    gone = rep.first(lambda s: vram_of(s, GAME) is None)
    assert all(s.paused and s.budget == 0 for s in rep.snaps[:gone])
    assert rep.events[0].paused and "EldenRing.exe (in a Steam game folder)" in rep.events[0].reason
    resumed = rep.first(lambda s: s.budget > 0)
    assert rep.snaps[resumed].time >= rep.snaps[gone].time + 3.0 - 1e-6
    assert not rep.snaps[-1].paused


def test_fixed_cap_and_live_changes_from_the_ui():
    rep = run_trace("game_launch", policy=BudgetPolicy(mode="fixed", user_cap=5 * GiB))
    assert {s.budget for s in rep.snaps} == {5 * GiB} and len(rep.events) == 1

    def ui(i, mon):
        if i == 10:
            mon.policy.set_mode("auto")
            mon.policy.set_user_cap(3 * GiB)
        if i == 20:
            mon.policy.set_user_cap(None)
    rep = run_trace("game_launch", policy=BudgetPolicy(mode="fixed", user_cap=5 * GiB), before_sample=ui)
    assert rep.snaps[9].budget == 5 * GiB and rep.snaps[10].budget == 3 * GiB and rep.snaps[10].mode == "auto"
    assert rep.snaps[20].budget > 3 * GiB
    assert "mode set to auto; user cap set to 3.0 GiB" in rep.events[1].reason


def test_wddm_says_not_available_and_counts_others_as_used_minus_ours():
    rep = run_trace("wddm")
    s = rep.snaps[-1]
    assert all(p.vram_bytes is None for p in s.processes)
    assert json.loads(json.dumps(s.as_dict()))["processes"][0]["vram_bytes"] is None
    assert s.others_vram == s.gpu.used and any("not available" in n for n in s.notes)
    games = {p.name: p.reason for p in s.processes if p.is_game}
    assert games == {"obs64.exe": "known creative tool: OBS Studio", "IndieGame.exe": "graphics context on the GPU"}

    def engine_reports(i, mon):
        mon.set_own_vram(2 * GiB)
    rep = run_trace("wddm", before_sample=engine_reports)
    s = rep.snaps[-1]
    assert s.own_vram == 2 * GiB and s.others_vram == s.gpu.used - 2 * GiB
    assert any("engine's figure" in n for n in s.notes)


def test_nvml_errors_become_statuses_and_notes_never_exceptions():
    rep = run_trace("nvml_errors")
    s0 = rep.snaps[0]
    assert s0.ok and s0.gpu.utilization is None and s0.gpu.pcie_gen is None
    not_supported = rep.snaps[5]
    assert not_supported.ok and "GPU 0 graphics process list: Not Supported" in not_supported.notes
    transient = rep.snaps[10]
    assert transient.status == "NVML error on GPU 0: Unknown Error"
    assert transient.budget == rep.snaps[9].budget            # held, not dropped to the CPU
    lost = rep.snaps[13]
    assert lost.status == f"{NO_GPU}: GPU is lost" and lost.budget is None and lost.gpus == ()
    assert rep.events[-1].budget is None and rep.events[-1].reason == f"{NO_GPU}: GPU is lost"


def test_nvml_comes_back_after_a_lost_gpu():
    from monitor.fake_nvml import FakeNvml
    from tests.monitor.helpers import TRACES
    fake = FakeNvml(TRACES / "nvml_errors.json")
    mon = fake.monitor(nvml=Nvml(fake, retry_s=0.0))
    mon.set_own_pids({WORKER_PID})
    snaps = fake.replay(mon)
    assert snaps[14].status.startswith(NO_GPU)           # the driver is down while the GPU is lost
    assert snaps[-1].ok and snaps[-1].budget is not None and mon.last_event().budget == snaps[-1].budget


def test_no_driver_is_a_status_and_a_none_budget():
    rep = run_trace("no_driver")
    s = rep.snaps[0]
    assert s.status == f"{NO_GPU}: NVML did not start (Driver Not Loaded)"
    assert s.budget is None and s.gpus == () and not s.gaming
    assert rep.events[0].budget is None and rep.events[0].previous is None


def test_two_gpus_budget_is_per_gpu_and_gaming_is_machine_wide():
    rep = run_trace("two_gpus")
    assert len(rep.events) == 1 and rep.snaps[-1].gaming and not rep.snaps[0].gaming
    assert {p.gpu_index for p in rep.snaps[-1].processes} == {0, 1}
    xorg = next(p for p in rep.snaps[0].processes if p.name == "Xorg")
    assert "graphics" in xorg.kinds and not xorg.is_game
    rep1 = run_trace("two_gpus", gpu_index=1)
    assert drops(rep1) and drops(rep1)[0].reason == "hl2_linux started (6.0 GiB)"
    rep9 = run_trace("two_gpus", gpu_index=9)
    assert rep9.snaps[0].status == f"{NO_GPU}: GPU index 9 not found (2 GPUs)" and rep9.snaps[0].budget is None
