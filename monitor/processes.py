"""Who a pid is: its name and executable from psutil, cached for as long as the pid stays on the GPU.

psutil is asked once per new pid (not at every sample). Where psutil may not look (a protected
anti-cheat process, a pid from another container), NVML's own process name is the fallback, and the
executable is "not available" (None).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Identity:
    name: str          # "" when unknown
    exe: str | None    # None when not available


class ProcessLookup(Protocol):
    def lookup(self, pid: int) -> Identity: ...
    def keep_only(self, pids: Iterable[int]) -> None: ...


class PsutilLookup:
    """The real lookup. `fallback_name(pid)` (NVML's process name) is used when psutil cannot tell."""

    def __init__(self, fallback_name: Callable[[int], str] | None = None) -> None:
        self._cache: dict[int, Identity] = {}
        self._fallback_name = fallback_name

    def lookup(self, pid: int) -> Identity:
        hit = self._cache.get(pid)
        if hit is None:
            hit = self._cache[pid] = self._ask(pid)
        return hit

    def keep_only(self, pids: Iterable[int]) -> None:
        """Forget pids that left the GPU, so a reused pid is looked up afresh."""
        alive = set(pids)
        for pid in [p for p in self._cache if p not in alive]:
            del self._cache[pid]

    def _ask(self, pid: int) -> Identity:
        import psutil

        name, exe = "", None
        try:
            proc = psutil.Process(pid)
            name = proc.name()
            exe = proc.exe() or None
        except (psutil.Error, OSError):
            pass
        if not name and self._fallback_name is not None:
            name = self._fallback_name(pid)
        return Identity(name=name, exe=exe)


class TableLookup:
    """A fixed pid -> Identity table (traces and tests); unknown pids are unknown."""

    def __init__(self, table: dict[int, Identity]) -> None:
        self._table = dict(table)

    def lookup(self, pid: int) -> Identity:
        return self._table.get(pid, Identity("", None))

    def keep_only(self, pids: Iterable[int]) -> None:
        pass
