"""`python -m monitor`: --once --json on this machine, replays, the live view, --known-apps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from monitor.__main__ import main
from tests.monitor.helpers import TRACES

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monitor", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, check=False)


def test_once_json_on_this_machine_exits_0_with_a_status():
    r = run("--once", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"status", "gpus", "processes", "budget"} <= d.keys()
    if d["status"].startswith("no NVIDIA GPU"):
        assert d["budget"] is None and d["gpus"] == []
    else:
        assert d["status"] == "ok" and d["gpus"]


def test_once_json_replaying_a_trace(capsys):
    assert main(["--once", "--json", "--replay", str(TRACES / "game_launch.json")]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["status"] == "ok" and d["budget"] > 0 and d["gpus"][0]["total"] == 16 << 30


def test_live_view_over_a_whole_replay(capsys):
    assert main(["--replay", str(TRACES / "game_exit.json"), "--interval", "0.001", "--refresh", "0"]) == 0
    out = capsys.readouterr().out
    assert "Slipstream monitor" in out and "EldenRing.exe" in out and "recent budget events" in out


def test_live_json_lines(capsys):
    assert main(["--replay", str(TRACES / "two_gpus.json"), "--json", "--interval", "0.001",
                 "--refresh", "0"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert len(lines) >= 2 and lines[-1]["gaming"] is True


def test_known_apps_prints_and_creates_the_users_file(tmp_path, capsys, monkeypatch):
    target = tmp_path / "known_apps.json"
    monkeypatch.setattr("monitor.known_apps.user_known_apps_path", lambda: target)
    assert main(["--known-apps"]) == 0
    assert capsys.readouterr().out.strip() == str(target) and target.exists()


def test_bad_flag_values_name_the_value():
    r = run("--cap", "lots")
    assert r.returncode == 2 and "lots" in r.stderr
