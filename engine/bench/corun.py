"""The co-run scenario: the game stand-in on the same GPU beside Slipstream (auto mode), then beside
llama.cpp (a fixed `-ngl` chosen at start), on a card capped at `--cap` (a client card on the H200).

Per system: start the stand-in at its first working set; start the model (Slipstream's co-run worker,
or llama-bench decoding 64 tokens per repetition with `--progress`); once it produces tokens, signal the
stand-in to run its phases (e.g. 6 GiB for 30 s, a level load to 20 GiB held 30 s, back to 6 GiB);
stop the model when the stand-in ends. Meanwhile this process polls NVML (both processes and the
device) every 0.1 s. Run it in a process that has not touched CUDA itself (it would count as another
process on the card). The result per system: a timeline (game frames/s, model tokens/s, VRAM of each,
budget events) and a summary (frames/s and tokens/s per phase, the game's simulated out-of-memory
stalls, seconds the card was over its cap, the model's errors).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from engine.bench.vram_poll import VramPoller
from engine.units import parse_bytes


@dataclass
class CorunConfig:
    cap: str = "24GiB"
    phases: str = "6GiB:20,16GiB:25,6GiB:20"
    load_rate: str = "3GiB"
    chunk: str = "256MiB"
    reserve: str = "1GiB"
    interval: float = 0.1           # the monitor's sampling interval in the Slipstream worker
    hysteresis: str = "512MiB"
    slack: str = "128MiB"
    fps: float = 60.0
    sim_dir: str | None = None      # dry run: a simulated card
    sim_context: str = "0"
    game_size: int = 8192
    startup_timeout_s: float = 240.0
    overhead_initial: str = "1GiB"
    overhead_step: str = "64MiB"
    force_plan: str = "auto"

    @classmethod
    def dry(cls, sim_dir: str) -> CorunConfig:
        return cls(cap="16MiB", phases="3MiB:3,12MiB:3,3MiB:3", load_rate="8MiB", chunk="256KiB",
                   reserve="1MiB", hysteresis="512KiB", slack="128KiB", sim_dir=sim_dir, sim_context="256KiB",
                   startup_timeout_s=120.0, overhead_initial="512KiB", overhead_step="16KiB", force_plan="gpu_only")


def _py(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if path.exists():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def start_game(cfg: CorunConfig, work: Path) -> subprocess.Popen:
    argv = _py("engine.bench.game_standin", "--cap", cfg.cap, "--phases", cfg.phases, "--load-rate", cfg.load_rate,
               "--chunk", cfg.chunk, "--fps", str(cfg.fps), "--size", str(cfg.game_size),
               "--log", str(work / "game.jsonl"), "--ready-file", str(work / "game.ready"),
               "--go-file", str(work / "go"))
    if cfg.sim_dir:
        argv += ["--sim-dir", cfg.sim_dir, "--sim-context", cfg.sim_context]
    with open(work / "game.out", "w") as out:      # the child keeps its own copy of the descriptor
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)


def read_jsonl(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


_REP = re.compile(r"(?<!warmup )generation run \d+/")


class ProgressClock:
    """Stamps llama-bench's `--progress` lines ("... generation run i/N", printed as repetition i starts;
    the warm-up's line excluded) as they arrive on stderr."""

    def __init__(self, stream, log_path: Path):
        self.stamps: list[float] = []
        self.first = threading.Event()
        self._t = threading.Thread(target=self._read, args=(stream, log_path), daemon=True)
        self._t.start()

    def _read(self, stream, log_path: Path) -> None:
        with open(log_path, "w") as log:
            for line in iter(stream.readline, ""):
                log.write(f"{time.time():.3f} {line}")
                if _REP.search(line):
                    self.stamps.append(time.time())
                    self.first.set()


def run_system(system: str, cfg: CorunConfig, work: Path, make_argv, env=None, say=print) -> dict:
    """One co-run: the game stand-in beside the model started by `make_argv()` (called once the game
    holds its first working set, so a fixed configuration can be chosen from what is free then)."""
    work.mkdir(parents=True, exist_ok=True)
    for f in ("go", "game.ready", "model.ready", "stop"):
        (work / f).unlink(missing_ok=True)
    nvml = None
    if cfg.sim_dir:
        from engine.bench.simcard import SimCard

        nvml = SimCard(cfg.sim_dir, total=parse_bytes(cfg.cap))
    game = start_game(cfg, work)
    model = None
    result: dict = {"system": system}
    model_argv: list[str] = []
    pids = [game.pid]
    with VramPoller(lambda: pids, 0.1, nvml=nvml) as poll:
        try:
            if not _wait_for(work / "game.ready", game, cfg.startup_timeout_s):
                result["error"] = "the game stand-in did not start: " + (work / "game.out").read_text()[-500:]
                return result
            model_argv = make_argv()
            result["command"] = " ".join(model_argv)
            t_model = time.time()
            with open(work / "model.out", "w") as out:
                model = subprocess.Popen(model_argv, stdout=out, stderr=subprocess.PIPE, text=True, env=env)
            pids.append(model.pid)
            clock = ProgressClock(model.stderr, work / "model.err")
            ready = work / "model.ready"
            t0 = time.monotonic()
            while not (ready.exists() or clock.first.is_set()):
                if model.poll() is not None or time.monotonic() - t0 > cfg.startup_timeout_s:
                    result["error"] = f"{system} did not start producing tokens (exit {model.poll()})"
                    return result
                time.sleep(0.1)
            result["model_startup_s"] = round(time.time() - t_model, 1)
            (work / "go").write_text("go")
            say(f"  co-run {system}: model ready after {result['model_startup_s']} s; game phases {cfg.phases}")
            game.wait(timeout=_phases_s(cfg.phases) + 120)
        finally:
            (work / "stop").write_text("stop")
            if model is not None:
                try:
                    model.wait(timeout=60 if "corun_slipstream" in " ".join(model_argv) else 1)
                except subprocess.TimeoutExpired:
                    model.kill()
                    model.wait()
            if game.poll() is None:
                game.kill()
                game.wait()
    result["vram"] = [[t, used, procs.get(game.pid, 0), procs.get(model.pid, 0) if model else 0]
                      for t, used, procs in ((s[0], s[1], s[2]) for s in poll.samples)]
    result["stamps"] = clock.stamps if model is not None else []
    (work / "vram.json").write_text(json.dumps(result["vram"]))
    return result


def _phases_s(spec: str) -> float:
    return sum(float(p.split(":")[1]) for p in spec.split(","))


def summarize(system: str, cfg: CorunConfig, work: Path, raw: dict, t_perf0: float | None = None) -> dict:
    """Timeline (seconds from the stand-in's start) and per-phase figures of one co-run."""
    game = read_jsonl(work / "game.jsonl")
    start = next((g for g in game if g.get("event") == "start"), None)
    if start is None:
        return {"system": system, "error": raw.get("error", "no game log"), "command": raw.get("command")}
    t0 = start["t"]
    cap = parse_bytes(cfg.cap)
    windows = [g for g in game if "fps" in g]
    end = next((g for g in game if g.get("event") == "end"), {})
    phase_bounds = []
    acc = 0.0
    for _, secs in (p.split(":") for p in cfg.phases.split(",")):
        phase_bounds.append((acc, acc + float(secs)))
        acc += float(secs)
    if system.startswith("slipstream"):
        model_log = read_jsonl(work / "model.jsonl")
        tok_windows = [(m["t"] - t0, m["tokens"] / m["window_s"]) for m in model_log
                      if "window_s" in m]
        budget_events = [[round(m["t"] - t0, 2), m["budget"], m.get("reason", "")] for m in model_log
                         if m.get("event") == "budget"]
        errors = [m for m in model_log if m.get("event") == "error"]
        model_vram = [[round(m["t"] - t0, 2), m.get("nvml_own"), m["budget"], m["engine_booked"]]
                      for m in model_log if "engine_booked" in m]
    else:
        st = raw.get("stamps", [])
        tok_windows = [(b - t0, 64 / (b - a)) for a, b in itertools.pairwise(st) if b > a]
        budget_events, errors, model_vram = [], [], []
    # the poller's clock is perf_counter: align it on the game's start by the first sample's wall time
    vram = raw.get("vram", [])
    offset = (time.time() - time.perf_counter()) if vram else 0.0
    vram_t = [[round(v[0] + offset - t0, 2), v[1], v[2], v[3]] for v in vram]
    over = [v for v in vram_t if v[1] > cap and v[0] >= 0]
    dt = 0.1
    per_phase = []
    for i, (a, b) in enumerate(phase_bounds):
        fps = [w["fps"] for w in windows if a <= w["t"] - t0 < b]
        tps = [r for t, r in tok_windows if a <= t < b]
        per_phase.append({"phase": i, "from_s": a, "to_s": b,
                          "game_fps": sum(fps) / len(fps) if fps else None,
                          "game_frame_ms_p99": max((w["frame_ms_p99"] for w in windows if a <= w["t"] - t0 < b),
                                                   default=None),
                          "model_tps": sum(tps) / len(tps) if tps else None})
    return {
        "system": system, "command": raw.get("command"), "cap_bytes": cap, "phases": cfg.phases,
        "model_startup_s": raw.get("model_startup_s"),
        "game_ooms": end.get("ooms"), "game_oom_stall_s": end.get("oom_stall_s"),
        "game_final_working_set": end.get("final_working_set"), "game_frames": end.get("frames"),
        "card_over_cap_s": round(len(over) * dt, 2),
        "card_peak_bytes": max((v[1] for v in vram_t), default=None),
        "model_errors": len(errors), "model_ooms": sum(1 for e in errors if e.get("oom")),
        "per_phase": per_phase,
        "timeline": {"game": [[round(w["t"] - t0, 2), round(w["fps"], 1), round(w["frame_ms_p99"], 2),
                               w["working_set"], w["card_used"], w["ooms"]] for w in windows],
                     "game_columns": ["t", "fps", "frame_ms_p99", "working_set", "card_used", "ooms"],
                     "model_tps": [[round(t, 2), round(r, 2)] for t, r in tok_windows],
                     "vram": vram_t[::2], "vram_columns": ["t", "device_used", "game", "model"],
                     "budget_events": budget_events, "model_vram": model_vram[::2],
                     "model_vram_columns": ["t", "nvml_own", "budget", "engine_booked"],
                     "oom_events": [[round(g["t"] - t0, 2), g.get("kind")] for g in game
                                    if g.get("event") == "oom"]},
    }
