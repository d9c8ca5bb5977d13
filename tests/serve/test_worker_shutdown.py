"""At shutdown the worker waits for its threads that call the engine (the budget and metrics loops) before
it closes the engine, so no thread is inside the engine while it closes or while the process exits (one
CI run saw the worker process abort at exit: "terminate called without an active exception")."""

from __future__ import annotations

import os
import threading
import time

import engine
from engine.worker import Worker
from tests.serve.events import EventSink


class SlowBudget:
    """The tiny engine, its budget changes taking half a second, its close recording which of the
    worker's engine threads were still running."""

    def __init__(self, eng, seen: list):
        self._engine, self._seen = eng, seen

    def set_vram_budget(self, n):
        time.sleep(0.5)
        return self._engine.set_vram_budget(n)

    def close(self):
        self._seen.append(sorted(t.name for t in threading.enumerate() if t.name in ("worker-budget",
                                                                                  "worker-metrics")))
        return self._engine.close()

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_shutdown_waits_for_a_budget_change_in_progress(tiny_model):
    seen: list = []
    sink = EventSink()
    worker = Worker(sink, opener=lambda source, **kw: SlowBudget(engine.open_model(source, **kw), seen),
                    metrics_interval_s=0.05)
    read, write = os.pipe()
    infile = os.fdopen(read, "rb")
    thread = threading.Thread(target=worker.run, args=(infile,), daemon=True)
    thread.start()
    sink.wait_for("ready")
    worker.handle({"type": "load", "id": "l", "source": str(tiny_model("llama")), "device": "sim",
                   "backend": "torch", "budget": None})
    sink.wait_for("loaded")
    worker.handle({"type": "set_budget", "bytes": 1 << 20})
    time.sleep(0.3)                     # (the budget loop is inside the engine's slow budget change now)
    os.close(write)                     # end of input: the worker shuts down
    thread.join(30)
    infile.close()
    assert not thread.is_alive()
    assert seen == [[]]                 # closed once, with neither engine thread running
    assert sink.wait_for("bye")
