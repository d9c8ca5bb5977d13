"""A game stand-in for the co-run: fixed GPU work per frame over a VRAM working set that grows at a
"level load" and shrinks when the level ends.

    python -m engine.bench.game_standin --cap 24GiB --phases 6GiB:30,20GiB:30,6GiB:30 --log game.jsonl

Each frame: `--matmuls` bf16 products of `--size`^2 matrices plus a read of `--touch` bytes of the
working set (a game sampling its textures), then a sleep to the next frame at `--fps` (vsync-like
pacing). Growth is in 256 MiB chunks at `--load-rate` bytes per second; shrinking frees at once.
A chunk that does not fit is retried every frame (the level load stalls): `ooms` counts the failed
attempts, `oom_stall_s` the seconds the load waited.

The card is `--cap` bytes, whatever the real GPU holds (a client card on the big H200): before each
chunk the stand-in reads NVML's used bytes for the whole device and, where the chunk would not fit
under the cap, records a simulated out-of-memory (a real game's allocation would fail there) and tries
again next frame. A real CUDA out-of-memory is recorded too. With `--sim-dir` it runs on the CPU
against a simulated card (`engine.bench.simcard`), sleeping instead of computing.

Log (JSON lines): a window every 0.5 s {t, phase, fps, frame_ms_p50, frame_ms_p99, working_set,
card_used, ooms}, an event per out-of-memory, and a final summary. The phase clock starts when
`--go-file` appears (or at once without one); `--ready-file` is written once the first phase's working
set is allocated and frames run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from engine.units import parse_bytes

CHUNK = 256 << 20


def parse_phases(spec: str) -> list[tuple[int, float]]:
    """"6GiB:30,20GiB:30" -> [(bytes, seconds), ...]."""
    out = []
    for part in spec.split(","):
        size, _, secs = part.partition(":")
        out.append((parse_bytes(size), float(secs)))
    return out


class Card:
    """The device's used bytes and where this process's working set lives (CUDA or a simulated card)."""

    def __init__(self, sim_dir: str | None):
        self.sim = None
        if sim_dir:
            from engine.bench.simcard import SimCard

            self.sim = SimCard(sim_dir)
            self.nvml, self.handle = self.sim, 0
        else:
            import pynvml

            pynvml.nvmlInit()
            self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)


class Game:
    def __init__(self, args):
        self.args = args
        self.card = Card(args.sim_dir)
        self.chunks: list = []
        self.ooms = 0                    # failed allocation attempts (one per frame while stalled)
        self.stall: dict | None = None   # the load stall in progress
        self.stall_s = 0.0
        self.events: list[dict] = []
        self.chunk = min(CHUNK, max(1, parse_bytes(args.chunk)))
        if self.card.sim is None:
            import torch

            self.torch = torch
            self.dev = torch.device("cuda", 0)
            n = args.size
            self.a = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            self.b = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            torch.cuda.synchronize()
        self.touch_at = 0

    @property
    def working_set(self) -> int:
        return len(self.chunks) * self.chunk

    def _publish(self) -> None:
        if self.card.sim is not None:
            self.card.sim.set_own(self.working_set + parse_bytes(self.args.sim_context), "game_standin")

    def grow_one(self, t: float) -> bool:
        """Allocate one chunk if the card has room under the cap; else count a (simulated) OOM."""
        used = self.card.used()
        cap = parse_bytes(self.args.cap)
        if used + self.chunk > cap:
            self._oom(t, "simulated (card cap)", used)
            return False
        if self.card.sim is not None:
            self.chunks.append(None)
        else:
            try:
                c = self.torch.empty(self.chunk, dtype=self.torch.uint8, device=self.dev)
                c.fill_(1)
                self.chunks.append(c)
            except self.torch.OutOfMemoryError:
                self._oom(t, "cuda", used)
                return False
        if self.stall is not None:                    # a stalled load goes on: log how long it waited
            self.events.append({"event": "oom_stall_end", "t": t, "stalled_s": t - self.stall["t"],
                                "attempts": self.stall["attempts"], "working_set": self.working_set})
            self.stall_s += t - self.stall["t"]
            self.stall = None
        self._publish()
        return True

    def _oom(self, t: float, kind: str, used: int) -> None:
        self.ooms += 1
        if self.stall is None:
            self.stall = {"t": t, "attempts": 0}
            self.events.append({"event": "oom", "t": t, "kind": kind, "card_used": used, "need": self.chunk,
                                "working_set": self.working_set})
        self.stall["attempts"] += 1

    def shrink_to(self, target: int) -> None:
        while self.working_set > target and self.chunks:
            self.chunks.pop()
        if self.card.sim is None:
            self.torch.cuda.empty_cache()
        self._publish()

    def frame(self) -> float:
        """One frame's work; returns its duration in ms."""
        t0 = time.perf_counter()
        if self.card.sim is not None:
            time.sleep(self.args.sim_frame_ms / 1e3)
        else:
            for _ in range(self.args.matmuls):
                self.a @ self.b
            touch = parse_bytes(self.args.touch)
            left = touch
            while left > 0 and self.chunks:
                c = self.chunks[self.touch_at % len(self.chunks)]
                self.touch_at += 1
                c[: min(left, c.numel())].sum()
                left -= c.numel()
            self.torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3


def run(args) -> dict:
    game = Game(args)
    phases = parse_phases(args.phases)
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 - open for the process's life

    def emit(rec: dict) -> None:
        if log:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    period = 1.0 / args.fps
    # First phase: allocate the base working set (no clock yet), then wait for the go signal.
    while game.working_set < phases[0][0]:
        if not game.grow_one(time.time()):
            time.sleep(period)
    game.frame()
    setup_ooms, game.ooms, game.stall, game.stall_s = game.ooms, 0, None, 0.0
    game.events.clear()
    if args.ready_file:
        Path(args.ready_file).write_text(str(os.getpid()))
    go = Path(args.go_file) if args.go_file else None
    waited = time.monotonic()
    while go is not None and not go.exists() and time.monotonic() - waited < args.max_wait_s:
        game.frame()
        time.sleep(period)
    t_start, next_frame, credit_t = time.time(), time.perf_counter(), time.perf_counter()
    credit = 0.0
    emit({"event": "start", "t": t_start, "phases": [[b, s] for b, s in phases], "cap": parse_bytes(args.cap),
          "setup_ooms": setup_ooms})
    window: list[float] = []
    window_t0, frames_total, slow = time.perf_counter(), 0, 0
    phase_end = 0.0
    for i, (target, secs) in enumerate(phases):
        phase_end += secs
        emit({"event": "phase", "t": time.time(), "index": i, "target": target})
        if game.working_set > target:
            game.shrink_to(target)
        while time.time() - t_start < phase_end:
            now = time.perf_counter()
            credit = min(credit + args.load_rate_bytes * (now - credit_t), 2.0 * game.chunk)
            credit_t = now
            if game.working_set < target and credit >= game.chunk and game.grow_one(time.time()):
                credit -= game.chunk
            ms = game.frame()
            window.append(ms)
            frames_total += 1
            slow += ms > 1e3 / args.fps
            if now - window_t0 >= 0.5:
                el = time.perf_counter() - window_t0
                emit({"t": time.time(), "phase": i, "fps": len(window) / el,
                      "frame_ms_p50": statistics.median(window),
                      "frame_ms_p99": sorted(window)[max(0, int(0.99 * len(window)) - 1)],
                      "working_set": game.working_set, "card_used": game.card.used(), "ooms": game.ooms})
                window, window_t0 = [], time.perf_counter()
            for ev in game.events:
                emit(ev)
            game.events.clear()
            next_frame += period
            delay = next_frame - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                next_frame = time.perf_counter()
    if game.stall is not None:
        game.stall_s += time.time() - game.stall["t"]
    summary = {"event": "end", "t": time.time(), "frames": frames_total, "seconds": time.time() - t_start,
               "ooms": game.ooms, "oom_stall_s": game.stall_s, "frames_over_budget": slow,
               "final_working_set": game.working_set}
    emit(summary)
    game.shrink_to(0)
    if game.card.sim is not None:
        game.card.sim.clear_own()
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default="24GiB", help="the card's size the stand-in accounts against")
    ap.add_argument("--phases", default="6GiB:30,20GiB:30,6GiB:30", help="working set:seconds, ...")
    ap.add_argument("--load-rate", default="3GiB", help="working-set growth per second at a level load")
    ap.add_argument("--chunk", default="256MiB")
    ap.add_argument("--fps", type=float, default=60.0, help="frame pacing (frames per second at most)")
    ap.add_argument("--matmuls", type=int, default=3)
    ap.add_argument("--size", type=int, default=8192, help="matrix size of the per-frame products")
    ap.add_argument("--touch", default="1GiB", help="working-set bytes read per frame")
    ap.add_argument("--log", default=None)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--go-file", default=None)
    ap.add_argument("--max-wait-s", type=float, default=300.0)
    ap.add_argument("--sim-dir", default=None, help="run against a simulated card in this folder")
    ap.add_argument("--sim-frame-ms", type=float, default=5.0)
    ap.add_argument("--sim-context", default="0", help="bytes a simulated CUDA context costs")
    args = ap.parse_args(argv)
    args.load_rate_bytes = parse_bytes(args.load_rate)
    summary = run(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
