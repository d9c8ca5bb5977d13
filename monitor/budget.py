"""The budget policy: how many bytes of VRAM Slipstream may use, and a `BudgetEvent` when that changes.

    room   = total - other processes' use - reserve          (never below 0)
    budget = min(user cap, room)                             mode "auto"
           = the user cap itself, whatever others use        mode "fixed" (the user's override)
           = 0 while a game runs, else as "auto"             mode "pause_when_gaming"

Fast path down: when the room falls below the budget, the budget follows at that same sample. Slow path
up: the room must stay at least `hysteresis` above the budget for `hold_s` seconds, and the budget then
rises only to the lowest room seen over that hold, so a loading screen's spikes cost one drop, not a
thrash. Every new budget sits `slack` below the room it was set from, so a process creeping up by a few
MiB does not re-plan the engine at every sample. The user's own changes (mode, cap, reserve) apply at
the next sample, without a hold. Time comes in as an argument: the policy is a pure state machine.

`total_cap` treats the GPU as holding at most that many bytes (a client card's size when a benchmark
runs on a larger one): every sample's total is min(total, total_cap).
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from monitor.units import format_size, parse_size

MODES = ("auto", "fixed", "pause_when_gaming")
_EPS = 1e-6   # seconds: a hold of 3 s sampled at 0.1 s ends at the 30th sample despite float sums


@dataclass(frozen=True, slots=True)
class BudgetEvent:
    time: float
    budget: int | None      # bytes Slipstream may use now; None = no GPU
    previous: int | None
    reason: str             # e.g. "game.exe grew to 9.8 GiB"
    mode: str
    paused: bool

    def as_dict(self) -> dict:
        return asdict(self)


class BudgetPolicy:
    """Thread-safe: the setters may be called from the UI while the sampling thread calls `update`."""

    def __init__(self, mode: str = "auto", user_cap: int | str | None = None, reserve: int | str = 1 << 30,
                 hold_s: float = 3.0, hysteresis: int | str = 512 << 20, slack: int | str = 128 << 20,
                 total_cap: int | str | None = None) -> None:
        self._lock = threading.Lock()
        self.total_cap = None if total_cap is None else parse_size(total_cap)
        self._mode = _check_mode(mode)
        self._cap = None if user_cap is None else parse_size(user_cap)
        self._reserve = parse_size(reserve)
        self.hold_s = float(hold_s)
        self.hysteresis = parse_size(hysteresis)
        self.slack = parse_size(slack)
        self._room: int | None = None          # the room the budget currently follows
        self._rise_since: float | None = None  # the room has stayed up since...
        self._rise_min = 0
        self._rise_cause = ""
        self._paused = False
        self._clear_since: float | None = None  # no game seen since... (to resume)
        self._budget: int | None = None
        self._last_mode = self._mode
        self._last_paused = False
        self._started = False
        self._pending: list[str] = []
        self._reset_room = False

    # --- the user's settings -------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @property
    def user_cap(self) -> int | None:
        return self._cap

    @property
    def reserve(self) -> int:
        return self._reserve

    @property
    def budget(self) -> int | None:
        return self._budget

    @property
    def paused(self) -> bool:
        return self._paused

    def set_mode(self, mode: str) -> None:
        with self._lock:
            self._mode = _check_mode(mode)
            self._pending.append(f"mode set to {mode}")

    def set_user_cap(self, cap: int | str | None) -> None:
        with self._lock:
            self._cap = None if cap is None else parse_size(cap)
            self._pending.append("user cap removed" if cap is None else f"user cap set to {format_size(self._cap)}")

    def set_reserve(self, reserve: int | str) -> None:
        with self._lock:
            self._reserve = parse_size(reserve)
            self._reset_room = True
            self._pending.append(f"reserve set to {format_size(self._reserve)}")

    # --- samples -------------------------------------------------------------------------------------
    def update(self, now: float, total: int, others: int, gaming: bool = False, gaming_reason: str = "",
               cause: str = "") -> BudgetEvent | None:
        """One sample of the budget's GPU. Returns an event when budget, pause or mode changed."""
        with self._lock:
            if self.total_cap is not None:
                total = min(total, self.total_cap)
            room = max(0, total - others - self._reserve)
            moved = self._follow_room(now, room, cause, others)
            pause_reason = self._follow_games(now, gaming, gaming_reason)
            if self._mode == "fixed":
                budget = max(0, total - self._reserve)
                budget = budget if self._cap is None else min(self._cap, budget)
            else:
                budget = self._room if self._cap is None else min(self._cap, self._room)
                budget = 0 if self._paused else budget
            if not self._started:
                moved = (f"first sample: {format_size(total)} total, others use {format_size(others)}, "
                         f"reserve {format_size(self._reserve)}")
            return self._emit(now, budget, [*self._pending, pause_reason, moved])

    def no_gpu(self, now: float, reason: str) -> BudgetEvent | None:
        """The GPU is gone (or never was): budget None, and a fresh start when it comes back."""
        with self._lock:
            self._room, self._rise_since, self._paused, self._clear_since = None, None, False, None
            return self._emit(now, None, [*self._pending, reason])

    def _follow_room(self, now: float, room: int, cause: str, others: int) -> str:
        if self._room is None or self._reset_room:
            self._room, self._reset_room, self._rise_since = self._settle(room), False, None
            return ""
        if room < self._room:   # fast path down
            self._room, self._rise_since = self._settle(room), None
            return cause or f"other processes' use rose to {format_size(others)}"
        if room < self._room + self.hysteresis:
            self._rise_since = None
            return ""
        if self._rise_since is None:   # slow path up: start the hold
            self._rise_since, self._rise_min, self._rise_cause = now, room, cause
        self._rise_min = min(self._rise_min, room)
        if now - self._rise_since < self.hold_s - _EPS:
            return ""
        self._room, self._rise_since = self._settle(self._rise_min), None
        why = self._rise_cause or f"other processes' use fell to {format_size(others)}"
        return f"{why}; the room stayed free for {self.hold_s:g} s"

    def _follow_games(self, now: float, gaming: bool, gaming_reason: str) -> str:
        if self._mode != "pause_when_gaming":
            self._paused, self._clear_since = False, None
            return ""
        if gaming:
            self._clear_since = None
            if not self._paused:
                self._paused = True
                return f"paused while gaming: {gaming_reason}" if gaming_reason else "paused while gaming"
            return ""
        if not self._paused:
            return ""
        if self._clear_since is None:
            self._clear_since = now
        if now - self._clear_since < self.hold_s - _EPS:
            return ""
        self._paused, self._clear_since = False, None
        return f"resumed: no game for {self.hold_s:g} s"

    def _settle(self, room: int) -> int:
        return max(0, room - self.slack)

    def _emit(self, now: float, budget: int | None, reasons: list[str]) -> BudgetEvent | None:
        self._pending = []
        changed = (not self._started or budget != self._budget or self._mode != self._last_mode
                   or self._paused != self._last_paused)
        if not changed:
            return None
        event = BudgetEvent(time=now, budget=budget, previous=self._budget,
                            reason="; ".join(r for r in reasons if r) or "budget changed",
                            mode=self._mode, paused=self._paused)
        self._started, self._budget, self._last_mode = True, budget, self._mode
        self._last_paused = self._paused
        return event


def _check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"budget mode {mode!r}: expected one of {', '.join(MODES)}")
    return mode
