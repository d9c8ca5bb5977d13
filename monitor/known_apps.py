"""Game and heavy-app detection: the shipped `known_apps.json` merged with the user's own copy.

A process counts as a game (or a heavy app Slipstream makes room for) when its name is a known game or
creative tool, when its executable lives in a store's game folder (Steam, Epic, Battle.net, ...), or
when it holds a graphics context on the GPU and is not an everyday desktop client (`not_games`). The
user's file lives in Slipstream's config folder (platformdirs, app name "Slipstream") and is merged in:
lists are joined, and a name in the user's `not_games` overrides everything.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

SHIPPED_PATH = Path(__file__).with_name("known_apps.json")
USER_FILE = "known_apps.json"
DEFAULT_MIN_GRAPHICS_VRAM = 256 << 20   # a graphics process smaller than this is a desktop app, not a game

_TEMPLATE = {
    "_help": "Your additions to Slipstream's list of games and heavy apps, merged with the shipped list "
             "(monitor/known_apps.json). apps: [{\"name\": \"My Game\", \"kind\": \"game\", \"exe\": "
             "[\"mygame\"]}]; game_folders: {\"D:/Games/\": \"my games\"}; not_games: process names that "
             "must never count as a game (overrides the shipped list).",
    "game_folders": {},
    "apps": [],
    "not_games": [],
}


def user_config_dir() -> Path:
    """Slipstream's config folder: platformdirs where installed, else the same places by hand."""
    try:
        from platformdirs import user_config_dir as _ucd
        return Path(_ucd("Slipstream", appauthor=False))
    except ImportError:
        pass
    if sys.platform == "win32":
        return Path(os.environ.get("APPDATA", Path.home() / "AppData" / "Roaming")) / "Slipstream"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "Slipstream"
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "Slipstream"


def user_known_apps_path() -> Path:
    return user_config_dir() / USER_FILE


def ensure_user_file(path: Path | None = None) -> Path:
    """Create the user's (empty, commented) list if missing; return its path. Never overwrites."""
    path = path or user_known_apps_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_TEMPLATE, indent=2) + "\n", encoding="utf-8")
    return path


def _norm_name(name: str) -> str:
    name = name.strip().lower()
    return name.removesuffix(".exe")


def _norm_path(path: str) -> str:
    return path.replace("\\", "/").lower()


@dataclass
class KnownApps:
    """The merged list. `classify(...)` returns why a process counts as a game, or ""."""
    apps: dict[str, tuple[str, str]] = field(default_factory=dict)   # norm exe name -> (display, kind)
    game_folders: dict[str, str] = field(default_factory=dict)       # norm path fragment -> store
    not_games: set[str] = field(default_factory=set)                 # norm names
    min_graphics_vram: int = DEFAULT_MIN_GRAPHICS_VRAM
    warnings: list[str] = field(default_factory=list)                # e.g. a user file that is not JSON

    @classmethod
    def load(cls, user_path: Path | None | bool = None) -> KnownApps:
        """Shipped list + the user's file (`None`: the default place; `False`: shipped only)."""
        known = cls()
        known.merge(json.loads(SHIPPED_PATH.read_text(encoding="utf-8")))
        if user_path is False:
            return known
        path = Path(user_path) if user_path else user_known_apps_path()
        try:
            if path.exists():
                known.merge(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            known.warnings.append(f"{path}: ignored, not a valid known-apps file ({exc})")
        return known

    def merge(self, data: dict) -> None:
        """Add one file's entries; `not_games` is checked first in `classify`, so it always wins."""
        for fragment, store in dict(data.get("game_folders", {})).items():
            self.game_folders[_norm_path(fragment)] = str(store)
        for app in data.get("apps", []):
            for exe in app.get("exe", []):
                self.apps[_norm_name(exe)] = (str(app.get("name", exe)), str(app.get("kind", "game")))
        self.not_games |= {_norm_name(n) for n in data.get("not_games", [])}

    def classify(self, name: str, exe: str | None, kinds: frozenset[str] | set[str],
                 vram: int | None) -> str:
        names = {_norm_name(name)} if name else set()
        if exe:
            names.add(_norm_name(exe.replace("\\", "/").rsplit("/", 1)[-1]))
        if names & self.not_games:
            return ""
        for n in names:
            if n in self.apps:
                display, kind = self.apps[n]
                return f"known {kind}: {display}"
        if exe:
            path = _norm_path(exe)
            for fragment, store in self.game_folders.items():
                if fragment in path:
                    return f"in a {store} game folder"
        if "graphics" in kinds and (vram is None or vram >= self.min_graphics_vram):
            return "graphics context on the GPU"
        return ""
