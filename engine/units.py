"""Byte sizes as users write them ("4GiB", "512 MB", 2**30) and as reports print them."""

from __future__ import annotations

import re

from engine.errors import BudgetError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: float | str, what: str = "size") -> int:
    """`"4GiB"` -> 4294967296; integers pass through. Raises BudgetError naming the value."""
    if isinstance(value, bool):
        raise BudgetError(f"{what}={value!r}: expected a number of bytes or a size such as '4GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise BudgetError(f"{what}={value!r}: must not be negative")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise BudgetError(f"{what}={value!r}: expected a number of bytes or a size such as '4GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
