"""The engine worker: one model in its own process, driven by JSON lines (docs/PROTOCOL.md).

`Worker` owns the protocol's behaviour. Requests arrive on stdin and are read on a reader thread, so
`cancel` and `set_budget` take effect in the middle of a generation. Long jobs (`load`, `generate`,
`unload`, `shutdown`) run one at a time on the main thread; budget changes run on a control thread that
coalesces them (only the newest budget matters). `api_start` / `api_stop` run the OpenAI-compatible API
server (engine/serve/) inside this process on the loaded engine: its generations and the chat's queue at
one `GenerationGate`. On an engine that batches (`submit`) the chat and the API's requests hold the gate
shared and run side by side in the engine's batched steps, each cancelled on its own; on other engines
(llama.cpp) one generation runs at a time. A load or unload holds the gate exclusively, so it waits for
running answers (chat and API) to end.
A metrics thread reports tokens/s, time to first token, the plan per tier and the engine's own VRAM a
few times a second, and notices re-plans the engine made on its own. Events go to the protocol stream only; anything else printed goes to stderr.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from engine.errors import SlipstreamError
from engine.generation import CancelToken
from engine.serve.gate import GateAbandoned, GenerationGate
from engine.serve.runner import _batches  # an engine with `submit` batches (llama.cpp's has none)

PROTOCOL_VERSION = 1
STOP_JOIN_S = 5.0          # at shutdown, the longest wait for a thread that calls the engine to end
_MODEL_SUFFIXES = (".safetensors", ".gguf", ".bin")


class EventWriter:
    """Writes one JSON object per line to the protocol stream, from any thread."""

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, type_: str, **fields: Any) -> None:
        line = json.dumps({"type": type_, **fields}, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            try:
                self._stream.write(line.encode("utf-8"))
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass  # the app is gone; the reader sees EOF and the worker shuts down


class TokenRate:
    """Rolling decode rate over the last `window_s` seconds of token timestamps."""

    def __init__(self, window_s: float = 2.0):
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque(maxlen=4096)
        self._lock = threading.Lock()      # ticks come from the chat and the API's threads at once

    def reset(self) -> None:
        with self._lock:
            self._times.clear()

    def tick(self, now: float) -> None:
        with self._lock:
            self._times.append(now)

    def rate(self, now: float) -> float | None:
        with self._lock:
            while self._times and now - self._times[0] > self.window_s:
                self._times.popleft()
            if len(self._times) < 2:
                return None
            span = self._times[-1] - self._times[0]
            return (len(self._times) - 1) / span if span > 0 else None


class Worker:
    """Executes protocol requests against one engine at a time."""

    def __init__(self, out: IO[bytes], *, opener: Callable[..., Any] | None = None,
                 metrics_interval_s: float = 0.25, pace_s: float = 0.0):
        self.events = EventWriter(out)
        self._opener = opener
        self.metrics_interval_s = metrics_interval_s
        self.pace_s = pace_s
        self._jobs: queue.Queue[dict | None] = queue.Queue()
        self._engine = None
        self._engine_lock = threading.RLock()
        self._model_info: dict = {}
        self._budget: int | None = None
        self._default_budget: int | None = None    # what the engine chose when opened without a budget
        self._budget_dirty = threading.Event()
        self._control_lock = threading.Lock()      # one engine control call (budget, force_plan) at a time
        self._current_id: str | None = None        # the chat generation running now
        self._current_cancel: CancelToken | None = None
        self._current_batched = False              # it runs in the engine's batch (cancel its token only)
        self._cancelled_ids: set[str] = set()
        self._cancel_lock = threading.Lock()       # the running chat vs cancels arriving for it
        self._rate = TokenRate()
        self._last_ttft: float | None = None
        self._last_plan: dict | None = None
        self._stop = threading.Event()
        self._gate = GenerationGate()              # generations (shared where the engine batches) or a load
        self._api = None                           # the running ApiServer, if any
        self._api_lock = threading.Lock()
        self._api_busy = 0
        self._busy_lock = threading.Lock()         # guards _api_busy
        self._api_key_source: str | None = None

    # ---- entry -----------------------------------------------------------------------------------
    def run(self, infile: IO[bytes]) -> int:
        """Serve requests from `infile` until `shutdown` or end of input; returns the exit status."""
        threading.Thread(target=self._read_loop, args=(infile,), name="worker-reader", daemon=True).start()
        # (the threads that call the engine: joined before it closes, so none is inside it at exit)
        users = [threading.Thread(target=self._budget_loop, name="worker-budget", daemon=True),
                 threading.Thread(target=self._metrics_loop, name="worker-metrics", daemon=True)]
        for t in users:
            t.start()
        self.events.emit("ready", protocol=PROTOCOL_VERSION, pid=os.getpid(),
                         python=sys.version.split()[0])
        while True:
            job = self._jobs.get()
            if job is None:
                break
            self._run_job(job)
        self._stop.set()
        for t in users:                  # (each ends within its poll interval once stopped)
            t.join(timeout=STOP_JOIN_S)
        self._stop_api()
        self._close_engine()
        self.events.emit("bye")
        return 0

    def _read_loop(self, infile: IO[bytes]) -> None:
        for raw in iter(infile.readline, b""):
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                request = json.loads(line)
            except ValueError as exc:
                request = f"not JSON ({exc})"
            if not isinstance(request, dict) or not isinstance(request.get("type"), str):
                why = request if isinstance(request, str) else "expected an object with a string 'type'"
                self.events.emit("error", id=None, message=f"bad request line {line[:80]!r}: {why}",
                                 kind="protocol")
                continue
            self.handle(request)
        self.handle({"type": "shutdown"})   # the app closed our stdin: it is gone or wants us gone

    # ---- dispatch (reader thread) ----------------------------------------------------------------
    def handle(self, request: dict) -> None:
        kind = request["type"]
        rid = request.get("id")
        if kind == "cancel":
            self._cancel(rid)
        elif kind == "set_budget":
            self._set_budget(request.get("bytes"))
        elif kind in ("plan_report", "stats", "force_plan"):
            threading.Thread(target=self._control, args=(request,), daemon=True).start()
        elif kind in ("load", "generate", "unload"):
            self._jobs.put(request)
        elif kind in ("api_start", "api_stop"):
            threading.Thread(target=self._api_request, args=(request,), daemon=True).start()
        elif kind == "shutdown":
            self._cancel(None)
            self._stop_api()
            self._jobs.put(None)
        else:
            self.events.emit("error", id=rid, message=f"unknown request type {kind!r}", kind="protocol")

    def _cancel(self, rid: str | None) -> None:
        """Cancel chat generation `rid` (running or queued); None cancels the chat that runs. A chat in
        the engine's batch is cancelled by its own token: the API's requests beside it go on."""
        with self._cancel_lock:
            if rid is not None and rid != self._current_id:
                self._cancelled_ids.add(rid)
                return
            token, current, batched = self._current_cancel, self._current_id, self._current_batched
        if token is not None:
            token.cancel()
        engine = self._engine
        if engine is not None and current is not None and not batched:
            engine.cancel()

    def _set_budget(self, value) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            self.events.emit("error", id=None, message=f"set_budget: bytes={value!r}: expected a "
                             "non-negative integer or null", kind="budget")
            return
        self._budget = value
        self._budget_dirty.set()

    # ---- control thread(s) -----------------------------------------------------------------------
    def _budget_loop(self) -> None:
        while not self._stop.is_set():
            if not self._budget_dirty.wait(0.2):
                continue
            self._budget_dirty.clear()
            with self._engine_lock:
                engine = self._engine
            if engine is None:
                continue   # applied at the next load
            budget = self._budget
            try:
                with self._control_lock:
                    target = self._default_budget if budget is None else budget
                    if target is not None:
                        engine.set_vram_budget(target)
                        _wait_for_budget(engine, target, self._budget_dirty)
                    self._emit_plan(engine, "budget", budget=budget)
            except SlipstreamError as exc:
                self.events.emit("error", id=None, message=str(exc), kind="budget")
            except Exception as exc:  # noqa: BLE001 - reported, the worker keeps serving
                self._internal_error(None, "budget", exc)

    def _control(self, request: dict) -> None:
        kind, rid = request["type"], request.get("id")
        engine = self._engine
        if engine is None:
            self.events.emit("error", id=rid, message=f"{kind}: no model is loaded", kind=kind)
            return
        try:
            if kind == "force_plan":
                with self._control_lock:
                    engine.force_plan(str(request.get("kind", "auto")))
                    self._emit_plan(engine, "forced", id=rid)
            elif kind == "plan_report":
                self._emit_plan(engine, "requested", id=rid)
            else:
                self.events.emit("stats", id=rid, stats=engine.stats())
        except SlipstreamError as exc:
            self.events.emit("error", id=rid, message=str(exc), kind=kind)
        except Exception as exc:  # noqa: BLE001
            self._internal_error(rid, kind, exc)

    def _emit_plan(self, engine, reason: str, **extra) -> None:
        report = _safe_plan_report(engine)
        self._last_plan = report
        self.events.emit("plan", reason=reason, report=report, **extra)

    def _metrics_loop(self) -> None:
        while not self._stop.wait(self.metrics_interval_s):
            engine = self._engine
            if engine is None:
                continue
            now = time.perf_counter()
            report = _safe_plan_report(engine)
            if self._control_lock.acquire(blocking=False):   # a budget change reports its own plan
                try:
                    if report is not None and self._last_plan is not None and \
                            _plan_signature(report) != _plan_signature(self._last_plan):
                        self._last_plan = report
                        self.events.emit("plan", reason="engine", report=report)
                finally:
                    self._control_lock.release()
            generating = self._current_id is not None or self._api_busy > 0
            self.events.emit("metrics", time=time.time(), generating=generating,
                             tokens_per_s=self._rate.rate(now) if generating else None,
                             ttft_s=self._last_ttft, plan=_plan_kinds(report),
                             own_vram=_plan_vram(report), budget=(report or {}).get("budget"))

    # ---- jobs (main thread) ----------------------------------------------------------------------
    def _run_job(self, job: dict) -> None:
        kind, rid = job["type"], job.get("id")
        try:
            if kind == "generate":
                self._generate(job)          # takes its own turn at the gate (shared where the engine batches)
            else:
                with self._gate.hold():
                    if kind == "load":
                        self._load(job)
                    elif kind == "unload":
                        self._close_engine()
                        self.events.emit("unloaded", id=rid)
        except SlipstreamError as exc:
            self.events.emit("error", id=rid, message=str(exc), kind=kind)
            if kind == "generate":
                self.events.emit("done", id=rid, finish_reason="error", stats={})
        except Exception as exc:  # noqa: BLE001 - the worker reports and keeps serving
            self._internal_error(rid, kind, exc)
            if kind == "generate":
                self.events.emit("done", id=rid, finish_reason="error", stats={})

    def _load(self, job: dict) -> None:
        rid = job.get("id")
        source = job.get("source")
        device = job.get("device") or "auto"
        backend = job.get("backend") or "auto"
        if "budget" in job:
            self._budget = job.get("budget")
        self._close_engine()
        self.events.emit("load_progress", id=rid, stage="opening", fraction=0.05,
                         message=f"opening {source or 'the bundled default model'}")
        t0 = time.perf_counter()
        opener = self._opener or _default_opener
        used_budget = self._budget
        engine = _open(opener, _as_model_path(source), device=device, vram_budget=used_budget, backend=backend,
                       progress=_ProgressRelay(self.events, rid))
        if used_budget is None:
            self._default_budget = getattr(engine, "budget", None)
        self.events.emit("load_progress", id=rid, stage="planning", fraction=0.9, message="planning")
        with self._engine_lock:
            self._engine = engine
            if self._budget == used_budget:
                self._budget_dirty.clear()
            else:
                self._budget_dirty.set()   # the budget moved while the model was loading
        self._model_info = model_info(engine, source, device, time.perf_counter() - t0)
        report = _safe_plan_report(engine)
        self._last_plan = report
        self.events.emit("load_progress", id=rid, stage="done", fraction=1.0, message="loaded")
        self.events.emit("loaded", id=rid, model=self._model_info, plan_report=report)

    def _generate(self, job: dict) -> None:
        rid = job.get("id")
        if self._take_cancelled(rid):
            self._emit_cancelled(rid)
            return
        engine = self._engine            # loads and unloads run on this thread: it stays for the whole job
        if engine is None:
            raise SlipstreamError("generate: no model is loaded (send 'load' first)")
        params = dict(job.get("params") or {})
        allowed = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed"}
        unknown = set(params) - allowed
        if unknown:
            raise SlipstreamError(f"generate: unknown params {sorted(unknown)} (allowed: {sorted(allowed)})")
        images = [_open_image(p) for p in job.get("images") or []] or None
        prompt = job.get("messages") if job.get("messages") is not None else job.get("prompt", "")
        batched = _batches(engine)
        try:
            self._gate.acquire(abandon=lambda: rid in self._cancelled_ids, shared=batched)
        except GateAbandoned:            # cancelled while an API answer held the engine
            self._take_cancelled(rid)
            self._emit_cancelled(rid)
            return
        try:
            self._stream(rid, engine, batched, prompt, images, params)
        finally:
            self._gate.release(shared=batched)

    def _stream(self, rid, engine, batched: bool, prompt, images, params: dict) -> None:
        """Run one chat generation and stream its events: in the engine's batch (`submit`, beside the
        API's requests) or alone (`generate`)."""
        token = CancelToken()
        with self._cancel_lock:
            cancelled = self._take_cancelled(rid)
            if not cancelled:
                self._current_id, self._current_cancel, self._current_batched = rid, token, batched
        if cancelled:
            self._emit_cancelled(rid)
            return
        if self._api_busy == 0:
            self._rate.reset()
        t0 = time.perf_counter()
        n = 0
        reason = "error"
        events = None
        try:
            start = engine.submit if batched else engine.generate
            events = start(prompt, images=images, cancel=token, **params)
            for ev in events:
                now = time.perf_counter()
                if ev.finish_reason is not None:
                    if ev.text:
                        self.events.emit("token", id=rid, text=ev.text, token_id=None, index=n)
                    reason = ev.finish_reason
                    break
                if n == 0:
                    self._last_ttft = now - t0
                self._rate.tick(now)
                self.events.emit("token", id=rid, text=ev.text, token_id=ev.token_id, index=n)
                n += 1
                if self.pace_s:
                    token._event.wait(self.pace_s)  # demo/test pacing; wakes at once on cancel
        finally:
            if events is not None:
                events.close()       # a request left early (a stop string) leaves the batch now
            with self._cancel_lock:
                self._current_id, self._current_cancel, self._current_batched = None, None, False
        stats = dict(engine.stats())
        if batched:
            stats.update(events.stats)   # this request's own figures, not the last of the batch to end
        stats["generated_tokens"] = n
        self.events.emit("done", id=rid, finish_reason=reason, stats=stats)

    def _take_cancelled(self, rid) -> bool:
        if rid in self._cancelled_ids:
            self._cancelled_ids.discard(rid)
            return True
        return False

    def _emit_cancelled(self, rid) -> None:
        """A chat cancelled before it started."""
        self.events.emit("done", id=rid, finish_reason="cancelled", stats={"generated_tokens": 0})

    def _close_engine(self) -> None:
        with self._engine_lock:
            engine, self._engine = self._engine, None
        self._last_plan = None
        if engine is not None:
            try:
                engine.close()
            except Exception as exc:  # noqa: BLE001
                self._internal_error(None, "close", exc)

    # ---- the OpenAI-compatible API (its own threads) -------------------------------------------------
    def _api_request(self, request: dict) -> None:
        kind, rid = request["type"], request.get("id")
        with self._api_lock:
            try:
                if kind == "api_stop":
                    self._stop_api()
                else:
                    self._start_api(request)
            except SlipstreamError as exc:
                self.events.emit("error", id=rid, message=str(exc), kind=kind)
                self._emit_api(rid, error=str(exc))
                return
            except Exception as exc:  # noqa: BLE001
                self._internal_error(rid, kind, exc)
                self._emit_api(rid, error=f"internal error: {type(exc).__name__}: {exc}")
                return
            self._emit_api(rid)

    def _start_api(self, request: dict) -> None:
        from engine.serve.auth import resolve_api_key
        from engine.serve.runner import EngineSlot
        from engine.serve.server import DEFAULT_PORT, ApiServer

        port = request.get("port", DEFAULT_PORT)
        host = request.get("host") or "127.0.0.1"
        key = request.get("key")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise SlipstreamError(f"api_start: port={port!r}: expected an integer from 0 to 65535")
        if not isinstance(host, str) or (key is not None and not isinstance(key, str)):
            raise SlipstreamError("api_start: host and key must be strings")
        self._api_key_source = "the app"
        if not key:
            key, self._api_key_source = resolve_api_key()
        old = self._api
        if old is not None and (old.host, old.port, old.api_key) == (host, port, key):
            return
        self._stop_api()
        slot = EngineSlot(lambda: self._engine, gate=self._gate, name=lambda: self._model_info.get("name"),
                          on_busy=self._api_activity, on_token=lambda: self._rate.tick(time.perf_counter()))
        server = ApiServer(slot, key, host=host, port=port,
                           log=lambda line: print(f"[api] {line}", file=sys.stderr, flush=True))
        server.start()
        self._api = server

    def _api_activity(self, busy: bool) -> None:
        with self._busy_lock:
            if busy and self._api_busy == 0 and self._current_id is None:
                self._rate.reset()       # a fresh rate when nothing else runs; beside others, their sum
            self._api_busy += 1 if busy else -1

    def _stop_api(self) -> None:
        server, self._api = self._api, None
        if server is not None:
            server.stop()

    def _emit_api(self, rid, error: str | None = None) -> None:
        server = self._api
        fields = {"running": server is not None, "address": server.address if server else None}
        if server is not None:
            fields["key_source"] = self._api_key_source
        if error:
            fields["error"] = error
        self.events.emit("api", id=rid, **fields)

    def _internal_error(self, rid, kind: str, exc: BaseException) -> None:
        traceback.print_exception(exc, file=sys.stderr)
        self.events.emit("error", id=rid, message=f"internal error in {kind}: {type(exc).__name__}: {exc}",
                         kind=kind)


# ---- helpers -------------------------------------------------------------------------------------
def _default_opener(source, **kwargs):
    from engine.api import open_model

    return open_model(source, **kwargs)


def _open(opener, source, *, progress, **kwargs):
    """Open with a progress callback where the backend takes one."""
    try:
        return opener(source, progress=progress, **kwargs)
    except TypeError as exc:
        if "progress" not in str(exc):
            raise
        return opener(source, **kwargs)


class _ProgressRelay:
    """A loader's progress callback, turned into `load_progress` events (at most 10 a second).

    Takes `(fraction)`, `(done, total)` or either with a message string, in any order."""

    def __init__(self, events: EventWriter, rid):
        self.events = events
        self.rid = rid
        self._last = 0.0

    def __call__(self, *args, **kwargs) -> None:
        numbers = [a for a in args if isinstance(a, (int, float)) and not isinstance(a, bool)]
        words = [a for a in args if isinstance(a, str)] + [str(v) for v in kwargs.values() if isinstance(v, str)]
        if len(numbers) >= 2 and numbers[1]:
            fraction = numbers[0] / numbers[1]
        elif numbers:
            fraction = float(numbers[0])
        else:
            fraction = kwargs.get("fraction")
        now = time.monotonic()
        if now - self._last < 0.1 and fraction not in (None, 1.0):
            return
        self._last = now
        if fraction is not None:
            fraction = 0.05 + 0.85 * max(0.0, min(1.0, float(fraction)))
        self.events.emit("load_progress", id=self.rid, stage="loading", fraction=fraction,
                         message=" ".join(words) or "loading weights")


def _as_model_path(source: str | None) -> str | None:
    """A GGUF file without the .gguf suffix (Ollama's blobs) gets a suffixed link in a cache folder."""
    if not source:
        return None
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() != ".gguf":
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError:
            return str(path)
        if magic == b"GGUF":
            link_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"slipstream-gguf-links-{os.getpid()}"
            link_dir.mkdir(parents=True, exist_ok=True)
            link = link_dir / (path.name.replace(":", "_") + ".gguf")
            if not link.exists():
                try:
                    link.symlink_to(path)
                except OSError:
                    return str(path)
            return str(link)
    return str(path)


def _open_image(path: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError) as exc:
        raise SlipstreamError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from exc


def _wait_for_budget(engine, target: int, newer: threading.Event, timeout_s: float = 1.0) -> None:
    """Mid-generation the engine applies a budget at its next sub-layer boundary: wait (briefly) until
    its plan report shows it, so the `plan` event carries the new plan. A newer budget ends the wait."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not newer.is_set():
        report = _safe_plan_report(engine)
        if report is None or report.get("budget") in (target, None):
            return
        time.sleep(0.01)


def _safe_plan_report(engine) -> dict | None:
    try:
        return engine.plan_report()
    except NotImplementedError:
        return None
    except Exception as exc:  # noqa: BLE001 - a report is informative; never fatal
        print(f"plan_report failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _plan_kinds(report: dict | None) -> dict[str, str]:
    if not report:
        return {}
    return {str(t.get("tokens")): str(t.get("plan")) for t in report.get("tiers", [])}


def _plan_signature(report: dict) -> tuple:
    tiers = tuple((t.get("tokens"), t.get("plan"), (t.get("vram") or {}).get("total"))
                  for t in report.get("tiers", []))
    return report.get("budget"), tiers


def _plan_vram(report: dict | None) -> int | None:
    if not report or not report.get("tiers"):
        return None
    return max(int((t.get("vram") or {}).get("total", 0)) for t in report["tiers"])


def model_info(engine, source: str | None, device: str, load_s: float) -> dict:
    """What the app shows about a loaded model."""
    path = Path(str(getattr(engine, "source", "") or source or ""))
    return {
        "name": path.stem if path.suffix.lower() == ".gguf" else path.name or "model",
        "source": source,
        "path": str(path),
        "backend": getattr(engine, "backend", "?"),
        "device": str(getattr(engine, "device", device)),
        "context_length": int(getattr(engine, "context_length", 0) or 0),
        "arch": getattr(getattr(engine, "config", None), "arch", None),
        "vision": bool(getattr(engine, "supports_images", False) or getattr(engine, "vision", False)),
        "weights_bytes": _weights_bytes(path),
        "load_s": round(load_s, 3),
    }


def _weights_bytes(path: Path) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.suffix in _MODEL_SUFFIXES)
    except OSError:
        pass
    return 0


def serve_stdio(*, pace_s: float = 0.0, metrics_interval_s: float = 0.25) -> int:
    """Run the worker on this process's stdin/stdout; stray prints (ours or a library's) go to stderr."""
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    worker = Worker(proto, pace_s=pace_s, metrics_interval_s=metrics_interval_s)
    return worker.run(sys.stdin.buffer)
