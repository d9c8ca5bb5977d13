"""The app as a program: `python -m app --help`, and no torch or engine import anywhere in app/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_app_never_imports_torch_or_the_engine():
    modules = sorted("app." + ".".join(p.relative_to(ROOT / "app").with_suffix("").parts)
                     for p in (ROOT / "app").rglob("*.py") if p.name != "__init__.py")
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules if not m.endswith("__main__")) +
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'llama_cpp')]\n"
            "print(bad)\nsys.exit(1 if bad else 0)\n")
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"QT_QPA_PLATFORM": "offscreen", "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr


def test_main_help():
    result = subprocess.run([sys.executable, "-m", "app", "--help"], check=False, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    for option in ("--show-chat", "--model", "--device"):
        assert option in result.stdout
