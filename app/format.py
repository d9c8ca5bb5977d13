"""Human-readable numbers for labels: byte sizes, rates, durations."""

from __future__ import annotations


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def format_rate(tokens_per_s: float | None) -> str:
    return "–" if tokens_per_s is None else f"{tokens_per_s:.1f} tok/s"


def format_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"
