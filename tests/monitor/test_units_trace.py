"""Sizes in words, and the trace format: loading, its errors, and recording a replayable trace."""

from __future__ import annotations

import json

import pytest

from monitor.fake_nvml import FakeNvml
from monitor.trace import load_trace, trace_from_snapshots
from monitor.units import format_size, parse_size
from tests.monitor.helpers import TRACES, run_trace


def test_sizes():
    assert parse_size("4GiB") == 4 << 30 and parse_size("512 MiB") == 512 << 20 and parse_size("1.5g") == 3 << 29
    assert parse_size(123) == 123 and parse_size("2GB") == 2 * 10**9
    assert format_size(9.8 * (1 << 30)) == "9.8 GiB" and format_size(512 << 20) == "512 MiB"
    assert format_size(None) == "n/a" and format_size(0) == "0 B"
    for bad in ("lots", "-1GiB", "4 parsecs"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(TypeError):
        parse_size(True)


def test_trace_expansion_and_defaults():
    t = load_trace(TRACES / "game_launch.json")
    assert len(t.frames) == 50 and t.frames[1].t == pytest.approx(0.1) and t.frames[-1].t == pytest.approx(4.9)
    first = t.frames[0].gpus[0]
    assert first.used == (400 << 20) + (6 << 30) + (550 << 20)     # baseline + the processes
    assert t.process_table[4242][0] == "Cyberpunk2077.exe"


def test_a_broken_trace_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": [{"name": "x", "total": "8GiB"}], "frames": [{"gpus": []}]}))
    with pytest.raises(ValueError, match=r"bad\.json.*frame 0"):
        load_trace(bad)


def test_recorded_snapshots_replay_to_the_same_view():
    rep = run_trace("level_load")
    recorded = json.loads(json.dumps(trace_from_snapshots(rep.snaps, "again")))
    fake = FakeNvml(recorded)
    mon = fake.monitor()
    mon.set_own_pids({5000})
    again = fake.replay(mon)
    assert [s.gpu.used for s in again] == [s.gpu.used for s in rep.snaps]
    assert [s.budget for s in again] == [s.budget for s in rep.snaps]
    assert [{(p.pid, p.vram_bytes, p.is_game) for p in s.processes} for s in again] == \
           [{(p.pid, p.vram_bytes, p.is_game) for p in s.processes} for s in rep.snaps]
