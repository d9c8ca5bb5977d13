"""Byte sizes for people: `format_size(n)` -> "9.8 GiB" and `parse_size("4GiB")` -> 4294967296.

The monitor's reasons, table and CLI flags all speak in these units.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def format_size(n: int | None) -> str:
    """Binary units with one decimal above a GiB: 0 B, 512 MiB, 9.8 GiB; None -> "n/a"."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 1 << 30:
        return f"{sign}{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{sign}{n / (1 << 20):.0f} MiB"
    if n >= 1 << 10:
        return f"{sign}{n / (1 << 10):.0f} KiB"
    return f"{sign}{n} B"


def parse_size(value: str | float) -> int:
    """"4GiB", "512 MiB", "1.5g", 1073741824 -> bytes. Raises ValueError naming the value."""
    if isinstance(value, bool):
        raise TypeError(f"size {value!r}: expected bytes or a string such as '4GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size {value!r}: must not be negative")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {value!r}: expected a number with an optional unit such as '4GiB' or '512MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
