"""The X11 platform check before the app starts: missing system libraries are named in one line with the
Debian packages that hold them, instead of Qt's abort."""

from __future__ import annotations

import sys

import pytest

from app import platform_check as pc

LDD = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibQt6XcbQpa.so.6 => /venv/PySide6/Qt/lib/libQt6XcbQpa.so.6 (0x00007f6b)
\tlibxcb-cursor.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibxkbcommon-x11.so.0 => not found
\tlibxcb-icccm.so.4 => not found
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f6a)
"""


def test_the_missing_libraries_come_from_ldd_once_each():
    assert pc.missing_libraries(ldd_output=LDD) == ["libxcb-cursor.so.0", "libxcb-icccm.so.4",
                                                    "libxkbcommon-x11.so.0"]
    assert pc.missing_libraries(ldd_output="\tlibc.so.6 => /lib/libc.so.6 (0x1)\n") == []


def test_this_machines_plugin_is_read_without_error():
    missing = pc.missing_libraries()
    assert isinstance(missing, list) and all(".so" in m for m in missing)


@pytest.mark.parametrize("soname,package", [("libxcb-icccm.so.4", "libxcb-icccm4"),
                                            ("libxcb-cursor.so.0", "libxcb-cursor0"),
                                            ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),
                                            ("libdbus-1.so.3", "libdbus-1-3"), ("libEGL.so.1", "libegl1"),
                                            ("libxcb-render-util.so.0", "libxcb-render-util0")])
def test_debian_packages_follow_the_soname(soname, package):
    assert pc.debian_package(soname) == package


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the X11 plugin is Linux's")
@pytest.mark.parametrize("env,xcb", [({"DISPLAY": ":0"}, True), ({}, False),
                                     ({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, False),
                                     ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, False),
                                     ({"QT_QPA_PLATFORM": "xcb"}, True),
                                     ({"WAYLAND_DISPLAY": "w", "QT_QPA_PLATFORM": "xcb;wayland"}, True)])
def test_the_check_applies_where_qt_would_pick_its_x11_plugin(env, xcb):
    assert pc.uses_xcb(env) is xcb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the X11 plugin is Linux's")
def test_the_problem_is_one_line_naming_libraries_and_packages():
    line = pc.platform_problem({"DISPLAY": ":0"}, missing=["libxcb-cursor.so.0", "libxcb-icccm.so.4"])
    assert "\n" not in line
    assert "libxcb-cursor.so.0, libxcb-icccm.so.4" in line
    assert line.endswith("sudo apt-get install libxcb-cursor0 libxcb-icccm4")
    assert pc.platform_problem({"DISPLAY": ":0"}, missing=[]) is None
    assert pc.platform_problem({"QT_QPA_PLATFORM": "offscreen"}, missing=["libxcb-cursor.so.0"]) is None


def test_the_app_stops_with_that_line_before_qt_starts(monkeypatch, capsys):
    """`python -m app` prints the line and exits 2, with no QApplication made."""
    import app.__main__ as main

    monkeypatch.setattr(pc, "platform_problem", lambda: "Slipstream: the display needs system libraries ...")
    assert main.run_app([]) == 2
    assert capsys.readouterr().err.strip() == "Slipstream: the display needs system libraries ..."
