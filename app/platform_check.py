"""Whether Qt's X11 platform plugin can start here (Linux), checked before the QApplication exists.

Without one of the system libraries the plugin links (libxcb-cursor0 and libxcb-icccm4 are often missing
on a fresh Debian or Ubuntu install), Qt aborts the process with a page about platform plugins that does
not name the library. This finds the missing ones with `ldd` and names them, with the packages that hold
them, in one line; `installers/dev.sh app` installs those packages where it may.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found", re.MULTILINE)


def xcb_plugin() -> Path | None:
    """PySide6's X11 platform plugin, where this PySide6 has one."""
    try:
        import PySide6
    except ImportError:
        return None
    path = Path(PySide6.__file__).parent / "Qt" / "plugins" / "platforms" / "libqxcb.so"
    return path if path.exists() else None


def uses_xcb(env=None) -> bool:
    """Whether Qt would pick its X11 plugin: Linux with an X display, and neither another plugin asked for
    (QT_QPA_PLATFORM) nor a Wayland session (where Qt picks its Wayland plugin first)."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux"):
        return False
    asked = env.get("QT_QPA_PLATFORM", "")
    if asked:
        return asked.split(":")[0].split(";")[0] == "xcb"
    return bool(env.get("DISPLAY")) and not env.get("WAYLAND_DISPLAY")


def missing_libraries(plugin: Path | None = None, ldd_output: str | None = None) -> list[str]:
    """The shared libraries the X11 plugin needs that the loader cannot find ([] where none, or where this
    cannot be told: no plugin, no `ldd`)."""
    if ldd_output is None:
        plugin = plugin or xcb_plugin()
        if plugin is None:
            return []
        try:
            ldd_output = subprocess.run(["ldd", str(plugin)], check=False, capture_output=True, text=True,
                                        timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return []
    return sorted(set(_NOT_FOUND.findall(ldd_output)))


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that holds a library by its soname, by the distributions' naming rule:
    `libxcb-icccm.so.4` -> `libxcb-icccm4`, `libxkbcommon-x11.so.0` -> `libxkbcommon-x11-0`,
    `libEGL.so.1` -> `libegl1`."""
    name, _, version = soname.partition(".so.")
    name = name.lower()
    if not version:
        return name
    return f"{name}-{version}" if name[-1].isdigit() else f"{name}{version}"


def platform_problem(env=None, missing: list[str] | None = None) -> str | None:
    """A one-line explanation where Qt's X11 plugin would fail to start here, else None."""
    if not uses_xcb(env):
        return None
    missing = missing_libraries() if missing is None else missing
    if not missing:
        return None
    packages = " ".join(dict.fromkeys(debian_package(m) for m in missing))
    return (f"Slipstream: the display needs system libraries this machine lacks ({', '.join(missing)}); "
            f"on Debian or Ubuntu: sudo apt-get install {packages}")


def main() -> int:
    """`python -m app.platform_check`: the Debian packages the X11 plugin still needs, one line (empty
    where none), whatever the current display (installers/dev.sh asks before it starts the app)."""
    print(" ".join(dict.fromkeys(debian_package(m) for m in missing_libraries())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
