"""User settings: one dataclass, stored as JSON in the user config folder.

Secrets never live here (see `app.secret_store`). A setting with a wrong type or value is reported in
one line and replaced by its default; an unreadable file is kept aside as `settings.json.bad` before
anything is written over it, so nothing the user wrote is lost.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

BUDGET_MODES = ("auto", "fixed", "pause_when_gaming")
DEVICES = ("auto", "cuda", "cpu", "sim")
BACKENDS = ("auto", "torch", "llamacpp")


@dataclass(slots=True)
class Settings:
    model_source: str | None = None          # None = the bundled default model
    device: str = "auto"
    backend: str = "auto"
    budget_mode: str = "auto"                 # "auto" | "fixed" | "pause_when_gaming"
    budget_cap: int | None = None             # bytes, used in "fixed" mode
    reserve: int = 1 << 30                    # VRAM the auto budget leaves free for everything else
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_p: float = 0.95
    system_prompt: str = ""
    api_port: int = 8765                      # the local OpenAI-compatible API (key in the keyring)
    api_enabled: bool = False                 # serve that API from the engine worker (127.0.0.1 only)
    chart_window_s: int = 120
    extra_model_dirs: list[str] = field(default_factory=list)

    def validate(self) -> list[str]:
        """Fix invalid values in place; return one line per fix."""
        problems: list[str] = []
        defaults = Settings()

        def reset(name: str, why: str) -> None:
            problems.append(f"settings: {name}={getattr(self, name)!r}: {why}; using {getattr(defaults, name)!r}")
            setattr(self, name, getattr(defaults, name))

        if self.budget_mode not in BUDGET_MODES:
            reset("budget_mode", f"expected one of {', '.join(BUDGET_MODES)}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            reset("device", f"expected one of {', '.join(DEVICES)} or cuda:N")
        if self.backend not in BACKENDS:
            reset("backend", f"expected one of {', '.join(BACKENDS)}")
        if self.budget_cap is not None and (not isinstance(self.budget_cap, int) or self.budget_cap < 0):
            reset("budget_cap", "expected a non-negative number of bytes or null")
        if not isinstance(self.reserve, int) or self.reserve < 0:
            reset("reserve", "expected a non-negative number of bytes")
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= 1 << 20:
            reset("max_new_tokens", "expected an integer from 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 5:
            reset("temperature", "expected a number from 0 to 5")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            reset("top_p", "expected a number in (0, 1]")
        if not isinstance(self.api_port, int) or not 1 <= self.api_port <= 65535:
            reset("api_port", "expected a port number from 1 to 65535")
        if not isinstance(self.api_enabled, bool):
            reset("api_enabled", "expected true or false")
        if not isinstance(self.chart_window_s, int) or not 10 <= self.chart_window_s <= 24 * 3600:
            reset("chart_window_s", "expected seconds from 10 to 86400")
        if not isinstance(self.extra_model_dirs, list) or not all(isinstance(d, str) for d in self.extra_model_dirs):
            reset("extra_model_dirs", "expected a list of folder paths")
        if self.model_source is not None and not isinstance(self.model_source, str):
            reset("model_source", "expected a path or null")
        if not isinstance(self.system_prompt, str):
            reset("system_prompt", "expected text")
        return problems


def load_settings(path: Path) -> tuple[Settings, list[str]]:
    """Read settings; returns them with the one-line problems found (missing file: defaults, none)."""
    if not path.exists():
        return Settings(), []
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raw = exc
    if not isinstance(raw, dict):
        why = raw if isinstance(raw, Exception) else "expected a JSON object"
        return Settings(), [(f"{path}: unreadable settings ({why}); using defaults (the file is kept as "
                             f"{path.name}.bad when settings are next saved)")]
    known = {f.name for f in fields(Settings)}
    problems = [f"{path}: unknown setting {k!r} ignored" for k in raw if k not in known]
    settings = Settings(**{k: v for k, v in raw.items() if k in known})
    problems += settings.validate()
    return settings, problems


def save_settings(settings: Settings, path: Path) -> None:
    """Write atomically (temp file + rename); an unreadable old file is kept as `.bad` first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            os.replace(path, path.with_name(path.name + ".bad"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
