"""The Monitor object: the sampling thread, subscribers, the bounded history, snapshots as values."""

from __future__ import annotations

import json
import os
import threading
import time

from monitor import Monitor, Snapshot
from monitor.fake_nvml import FakeNvml
from tests.monitor.helpers import TRACES, WORKER_PID, run_trace


def wait_for(pred, timeout: float = 20.0) -> None:
    """Poll until pred() holds; a generous deadline only to keep a broken test from hanging."""
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "gave up waiting"
        time.sleep(0.01)


def test_background_thread_samples_publishes_and_stops():
    fake = FakeNvml(TRACES / "game_launch.json")
    mon = fake.monitor(interval_s=0.01)
    got = []
    unsubscribe = mon.subscribe(got.append)
    mon.start()
    mon.start()                                     # idempotent
    wait_for(lambda: len(mon.history()) >= 3 and got)
    mon.stop()
    assert not any(t.name == "slipstream-monitor" for t in threading.enumerate())
    assert got[0].budget == mon.latest().budget and mon.last_event() is got[0]
    unsubscribe()
    unsubscribe()                                   # twice is harmless
    fake.advance()
    for _ in range(25):
        fake.advance()
    mon.sample_once()
    assert len(got) == 1


def test_a_failing_subscriber_does_not_stop_the_others():
    fake = FakeNvml(TRACES / "game_exit.json")
    mon = fake.monitor()
    seen = []

    def bad(ev):
        raise RuntimeError("subscriber bug")
    mon.subscribe(bad)
    mon.subscribe(seen.append)
    mon.sample_once()
    assert len(seen) == 1


def test_history_is_bounded_and_filters_by_time():
    fake = FakeNvml(TRACES / "alt_tab.json")
    mon = fake.monitor(interval_s=0.1, history_s=5.0)
    fake.replay(mon)
    hist = mon.history()
    assert len(hist) == mon.stats()["history_capacity"] == 50
    assert hist[-1] is mon.latest() and hist[0].time < hist[-1].time
    last2 = mon.history(2.0)
    assert all(s.time >= hist[-1].time - 2.0 for s in last2) and len(last2) in (20, 21)
    assert mon.stats()["samples"] == len(fake.trace.frames)


def test_unchanged_processes_are_shared_between_snapshots():
    rep = run_trace("game_exit")
    a, b = rep.snaps[0].processes, rep.snaps[1].processes
    assert all(x is y for x, y in zip(a, b, strict=True))


def test_own_pids_and_this_process_count_as_ours():
    fake = FakeNvml(TRACES / "game_launch.json")
    mon = fake.monitor()
    s = mon.sample_once()
    assert s.own_vram == 0 and s.others_vram == s.gpu.used          # the worker is not known yet
    mon.set_own_pids({WORKER_PID})
    s = mon.sample_once()
    assert s.own_vram == 6 << 30 and s.others_vram == s.gpu.used - (6 << 30)
    assert os.getpid() in mon._own


def test_snapshot_is_frozen_and_json_ready():
    s = run_trace("wddm").snaps[-1]
    assert isinstance(s, Snapshot)
    d = json.loads(json.dumps(s.as_dict()))
    assert {"status", "gpus", "processes", "budget"} <= d.keys()
    assert d["gpus"][0]["name"] == "NVIDIA GeForce RTX 3070" and d["processes"][0]["kinds"]
    try:
        s.budget = 1
    except AttributeError:
        pass
    else:
        raise AssertionError("Snapshot must be frozen")


def test_monitor_without_a_gpu_is_quiet_and_cheap():
    mon = Monitor(nvml=FakeNvml(TRACES / "no_driver.json"))
    for _ in range(3):
        s = mon.sample_once()
    assert s.status.startswith("no NVIDIA GPU") and s.budget is None
    assert mon.stats()["samples"] == 3
