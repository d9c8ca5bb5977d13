"""The package's promises: no torch or Qt on import, the overhead meter, the terminal table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from monitor.fake_nvml import FakeNvml
from monitor.overhead import measure_overhead
from monitor.table import render
from tests.monitor.helpers import TRACES, run_trace

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_monitor_pulls_in_neither_torch_nor_qt():
    code = ("import sys, monitor, monitor.__main__, monitor.fake_nvml, monitor.overhead, monitor.table, "
            "monitor.trace; m = monitor.Monitor(); m.sample_once(); "
            "bad = [n for n in ('torch', 'PySide6', 'pyqtgraph', 'PyQt5', 'PyQt6') if n in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_public_names():
    import monitor
    for name in ("Monitor", "BudgetPolicy", "BudgetEvent", "Snapshot", "GpuSample", "ProcessSample"):
        assert hasattr(monitor, name)


def test_overhead_meter_reports_samples_and_cpu():
    mon = FakeNvml(TRACES / "game_launch.json").monitor(interval_s=0.01)
    out = measure_overhead(mon, seconds=0.3)
    assert out["samples"] > 0 and out["cpu_percent_of_one_core"] >= 0 and out["interval_s"] == 0.01


def test_table_shows_gpus_processes_and_why():
    rep = run_trace("game_launch")
    text = render(rep.snaps[-1], rep.events)
    assert "NVIDIA GeForce RTX 4080" in text and "PCIe 4.0 x16" in text
    assert "Cyberpunk2077.exe  [in a Steam game folder]" in text and "ours" in text
    assert "Cyberpunk2077.exe grew to 7.0 GiB" in text
    wddm = render(run_trace("wddm").snaps[-1])
    assert "n/a" in wddm and "note:" in wddm
    nogpu = render(run_trace("no_driver").snaps[-1])
    assert "no NVIDIA GPU" in nogpu
