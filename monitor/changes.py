"""Why other processes' VRAM moved between two samples, in words: "game.exe grew to 9.8 GiB".

The budget policy quotes this text in its events, so the user sees which process took or gave back
the room.
"""

from __future__ import annotations

from monitor.snapshot import ProcessSample
from monitor.units import format_size


def describe_change(before: dict[int, ProcessSample], after: dict[int, ProcessSample],
                    others_before: int | None, others_after: int) -> str:
    """`before`/`after`: pid -> other processes (not ours) on the budget's GPU."""
    rising = others_before is None or others_after >= others_before
    best, best_delta = "", 0
    for pid in before.keys() | after.keys():
        old, new = before.get(pid), after.get(pid)
        delta = (_vram(new) - _vram(old)) * (1 if rising else -1)
        text = _one(old, new)
        if text and (delta > best_delta or (not best and delta >= 0)):
            best, best_delta = text, delta
    if best:
        return best
    verb = "rose" if rising else "fell"
    return f"other processes' use {verb} to {format_size(others_after)}"


def _vram(p: ProcessSample | None) -> int:
    return (p.vram_bytes or 0) if p is not None else 0


def _one(old: ProcessSample | None, new: ProcessSample | None) -> str:
    if new is None and old is not None:
        return f"{old.label} exited"
    if new is None:
        return ""
    if old is None:
        size = f" ({format_size(new.vram_bytes)})" if new.vram_bytes is not None else ""
        return f"{new.label} started{size}"
    if new.vram_bytes is None or old.vram_bytes is None or new.vram_bytes == old.vram_bytes:
        return ""
    verb = "grew" if new.vram_bytes > old.vram_bytes else "shrank"
    return f"{new.label} {verb} to {format_size(new.vram_bytes)}"
