"""Game and heavy-app detection: the shipped list, the user's file merged in, the graphics rule."""

from __future__ import annotations

import json
import sys

from monitor.known_apps import KnownApps, ensure_user_file, user_config_dir

G = frozenset({"graphics"})
C = frozenset({"compute"})


def test_store_folders_known_apps_and_the_graphics_rule():
    k = KnownApps.load(False)
    steam = "C:\\Program Files (x86)\\Steam\\steamapps\\common\\Hades\\Hades.exe"
    assert k.classify("Hades.exe", steam, G, 2 << 30) == "in a Steam game folder"
    assert k.classify("game", "/home/u/Games/Heroic/Celeste/game", C, None) == "in a Heroic game folder"
    assert k.classify("obs64.exe", None, C, 300 << 20) == "known creative tool: OBS Studio"
    assert k.classify("blender", "/opt/blender/blender", C, 1 << 30) == "known creative tool: Blender"
    assert k.classify("Resolve.exe", None, C, None) == "known creative tool: DaVinci Resolve"
    assert k.classify("mystery", "/x/mystery", G, 1 << 30) == "graphics context on the GPU"
    assert k.classify("mystery", "/x/mystery", G, None) == "graphics context on the GPU"   # WDDM: n/a


def test_desktop_clients_and_small_graphics_users_are_not_games():
    k = KnownApps.load(False)
    assert k.classify("Xorg", "/usr/lib/xorg/Xorg", G, 500 << 20) == ""
    assert k.classify("dwm.exe", "C:\\Windows\\System32\\dwm.exe", G, None) == ""
    assert k.classify("firefox", "/usr/lib/firefox/firefox", G, 900 << 20) == ""
    assert k.classify("tiny-gl-app", None, G, 20 << 20) == ""
    assert k.classify("python", "/usr/bin/python3", C, 8 << 30) == ""


def test_the_users_file_adds_and_overrides(tmp_path):
    user = tmp_path / "known_apps.json"
    user.write_text(json.dumps({
        "apps": [{"name": "My Sim", "kind": "game", "exe": ["mysim.exe"]}],
        "game_folders": {"D:\\Games\\": "my own"},
        "not_games": ["obs64"],
    }))
    k = KnownApps.load(user)
    assert k.classify("MySim.exe", None, C, None) == "known game: My Sim"
    assert k.classify("x", "D:\\Games\\X\\x.exe", C, None) == "in a my own game folder"
    assert k.classify("obs64.exe", None, G, 1 << 30) == ""       # the user said so
    assert k.classify("blender", None, C, None) == "known creative tool: Blender"   # shipped still there
    assert not k.warnings


def test_a_broken_user_file_is_a_warning_not_a_crash(tmp_path):
    user = tmp_path / "known_apps.json"
    user.write_text("{not json")
    k = KnownApps.load(user)
    assert len(k.warnings) == 1 and str(user) in k.warnings[0]
    assert k.classify("obs64.exe", None, C, None) == "known creative tool: OBS Studio"


def test_ensure_user_file_creates_a_template_once(tmp_path):
    path = tmp_path / "cfg" / "known_apps.json"
    assert ensure_user_file(path) == path
    data = json.loads(path.read_text())
    assert data["apps"] == [] and data["not_games"] == [] and "_help" in data
    path.write_text('{"apps": [{"name": "Mine", "exe": ["mine"]}]}')
    ensure_user_file(path)
    assert "Mine" in path.read_text()
    assert KnownApps.load(path).classify("mine", None, C, None) == "known game: Mine"


def test_config_dir_without_platformdirs(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "platformdirs", None)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    if sys.platform.startswith("linux"):
        assert user_config_dir() == tmp_path / "Slipstream"
    assert user_config_dir().name == "Slipstream"
