"""The Monitor: samples NVML on a background thread, keeps the history, runs the budget policy and
hands budget events to subscribers.

One sample = one round of NVML reads (memory, utilisation, PCIe, compute and graphics process lists),
cached psutil look-ups for new pids, game detection, and one policy update. It never raises: with no
NVIDIA GPU the snapshot's status says why and the budget is None.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

from monitor.budget import BudgetEvent, BudgetPolicy
from monitor.changes import describe_change
from monitor.devices import RawProcess, read_devices
from monitor.history import History
from monitor.known_apps import KnownApps
from monitor.nvml import NotAvailable, Nvml
from monitor.processes import ProcessLookup, PsutilLookup
from monitor.snapshot import NO_GPU, GpuSample, ProcessSample, Snapshot

log = logging.getLogger(__name__)


class Monitor:
    """`Monitor(interval_s=0.1, policy=BudgetPolicy(), gpu_index=0, nvml=None)`; nvml None = pynvml."""

    def __init__(self, interval_s: float = 0.1, policy: BudgetPolicy | None = None, gpu_index: int = 0,
                 nvml: ModuleType | Nvml | Any | None = None, *, history_s: float = 600.0,
                 processes: ProcessLookup | None = None, known_apps: KnownApps | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s {interval_s}: must be above 0")
        self.interval_s = interval_s
        self.policy = policy or BudgetPolicy()
        self.gpu_index = gpu_index
        self._nvml = nvml if isinstance(nvml, Nvml) else Nvml(nvml)
        self._lookup = processes or PsutilLookup(fallback_name=self._nvml_process_name)
        self._known = known_apps if known_apps is not None else KnownApps.load()
        self._clock = clock
        self._history = History(max(1, int(history_s / interval_s)))
        self._own: frozenset[int] = frozenset({os.getpid()})
        self._own_hint: int | None = None
        self._subs: list[Callable[[BudgetEvent], None]] = []
        self._subs_lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_event: BudgetEvent | None = None
        self._prev_procs: dict[tuple[int, int], ProcessSample] = {}
        self._prev_others: dict[int, ProcessSample] = {}
        self._prev_others_vram: int | None = None
        self._samples, self._busy_s, self._max_s = 0, 0.0, 0.0

    # --- what the app sets -------------------------------------------------------------------------
    def set_own_pids(self, pids: Iterable[int]) -> None:
        """Slipstream's processes: their VRAM is ours, not "others". This process always counts."""
        self._own = frozenset({os.getpid(), *pids})

    def set_own_vram(self, nbytes: int | None) -> None:
        """The engine's own figure for its VRAM, used when the driver attributes none to our pids
        (Windows WDDM, MIG, a container whose pids NVML cannot see). None: no figure."""
        self._own_hint = nbytes

    def subscribe(self, callback: Callable[[BudgetEvent], None]) -> Callable[[], None]:
        """callback(BudgetEvent), called from the sampling thread; returns a function that unsubscribes."""
        with self._subs_lock:
            self._subs.append(callback)

        def unsubscribe() -> None:
            with self._subs_lock:
                if callback in self._subs:
                    self._subs.remove(callback)
        return unsubscribe

    # --- running -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="slipstream-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def close(self) -> None:
        """Stop sampling and shut NVML down."""
        self.stop()
        self._nvml.close()

    def __enter__(self) -> Monitor:  # noqa: PYI034
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:
                log.exception("monitor sample failed")
            due += self.interval_s
            delay = due - time.monotonic()
            if delay < 0:   # fell behind (a suspended laptop): skip the missed samples
                due, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    # --- reading -----------------------------------------------------------------------------------
    def latest(self) -> Snapshot | None:
        return self._history.latest()

    def history(self, seconds: float | None = None) -> list[Snapshot]:
        return self._history.since(seconds)

    def last_event(self) -> BudgetEvent | None:
        """The newest budget event (a late subscriber's starting point)."""
        return self._last_event

    def stats(self) -> dict:
        """Samples taken and the time spent in them (wall clock, including NVML)."""
        n = self._samples
        return {"samples": n, "mean_sample_ms": 1000 * self._busy_s / n if n else 0.0,
                "max_sample_ms": 1000 * self._max_s, "history_len": len(self._history),
                "history_capacity": self._history.capacity}

    def sample_once(self) -> Snapshot:
        """One synchronous sample; events it causes go to subscribers from the calling thread."""
        with self._sample_lock:
            t0 = time.perf_counter()
            snap, event = self._sample()
            self._history.append(snap)
            took = time.perf_counter() - t0
            self._samples, self._busy_s, self._max_s = self._samples + 1, self._busy_s + took, max(self._max_s, took)
            if event is not None:
                self._last_event = event
        if event is not None:
            self._publish(event)
        return snap

    def _sample(self) -> tuple[Snapshot, BudgetEvent | None]:
        now, wall, policy = self._clock(), time.time(), self.policy
        notes = tuple(self._known.warnings)
        reason = self._nvml.open()
        if reason:
            return self._no_gpu(now, wall, reason, notes)
        read = read_devices(self._nvml)
        if read.fatal is not None:
            self._nvml.close(read.fatal.reason)
            return self._no_gpu(now, wall, read.fatal.reason, notes)
        notes += tuple(read.notes)
        procs = self._identify(read.processes)
        gpu = next((g for g in read.gpus if g.index == self.gpu_index), None)
        if gpu is None:
            failed = read.failed.get(self.gpu_index)
            if failed is None:
                return self._no_gpu(now, wall, f"GPU index {self.gpu_index} not found "
                                    f"({len(self._nvml.handles)} GPUs)", notes)
            # A transient error: keep the last budget rather than thrash the engine onto the CPU.
            return Snapshot(now, wall, f"NVML error on GPU {self.gpu_index}: {failed.reason}",
                            tuple(read.gpus), procs, policy.budget, any(p.is_game for p in procs),
                            gpu_index=self.gpu_index, mode=policy.mode, paused=policy.paused,
                            notes=notes), None
        own_vram, others_vram, own_note = self._split(gpu, procs)
        notes += own_note
        games = [p for p in procs if p.is_game]
        gaming_reason = f"{games[0].label} ({games[0].reason})" if games else ""
        others = {p.pid: p for p in procs if p.gpu_index == self.gpu_index and not p.is_own}
        cause = describe_change(self._prev_others, others, self._prev_others_vram, others_vram)
        self._prev_others, self._prev_others_vram = others, others_vram
        event = policy.update(now, gpu.total, others_vram, bool(games), gaming_reason, cause)
        snap = Snapshot(now, wall, "ok", tuple(read.gpus), procs, policy.budget, bool(games), own_vram,
                        others_vram, self.gpu_index, policy.mode, policy.paused, notes)
        return snap, event

    def _no_gpu(self, now: float, wall: float, reason: str, notes: tuple[str, ...]
                ) -> tuple[Snapshot, BudgetEvent | None]:
        status = f"{NO_GPU}: {reason}"
        self._prev_others, self._prev_others_vram = {}, None
        event = self.policy.no_gpu(now, status)
        return Snapshot(now, wall, status, gpu_index=self.gpu_index, mode=self.policy.mode, notes=notes), event

    def _identify(self, raw: list[RawProcess]) -> tuple[ProcessSample, ...]:
        out, seen = [], {}
        own = self._own
        for r in raw:
            key = (r.pid, r.gpu_index)
            is_own = r.pid in own
            p = self._prev_procs.get(key)
            # Unchanged since the last sample: reuse it (no look-up, and the history shares the object).
            if p is None or p.vram_bytes != r.vram or p.kinds != r.kinds or p.is_own != is_own:
                ident = self._lookup.lookup(r.pid)
                kinds = frozenset(r.kinds)
                reason = "" if is_own else self._known.classify(ident.name, ident.exe, kinds, r.vram)
                p = ProcessSample(r.pid, ident.name, ident.exe, r.vram, r.gpu_index, kinds, bool(reason), is_own,
                                  reason)
            seen[key] = p
            out.append(p)
        self._prev_procs = seen
        self._lookup.keep_only(r.pid for r in raw)
        return tuple(out)

    def _split(self, gpu: GpuSample, procs: tuple[ProcessSample, ...]) -> tuple[int, int, tuple[str, ...]]:
        """(own, others, notes): others = device used minus our own share, never a per-process guess."""
        mine = [p.vram_bytes for p in procs if p.is_own and p.gpu_index == gpu.index]
        reported = [v for v in mine if v is not None]
        note: tuple[str, ...] = ()
        if reported:
            own = sum(reported)
        elif self._own_hint is not None:
            own = self._own_hint
            note = ("own VRAM: the engine's figure (the driver attributes none to our processes)",)
        else:
            own = 0
            if mine:
                note = ("own VRAM: not available from the driver and not reported by the engine",)
        return own, max(0, gpu.used - own), note

    def _publish(self, event: BudgetEvent) -> None:
        with self._subs_lock:
            subs = list(self._subs)
        for cb in subs:
            try:
                cb(event)
            except Exception:
                log.exception("budget event subscriber failed")

    def _nvml_process_name(self, pid: int) -> str:
        name = self._nvml.call("nvmlSystemGetProcessName", pid)
        if isinstance(name, NotAvailable):
            return ""
        name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        return name.replace("\\", "/").rsplit("/", 1)[-1]
