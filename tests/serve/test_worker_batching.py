"""The worker's chat beside the API's requests: on an engine that batches, a tray chat and API requests
share the engine's batched steps and each gets exactly the tokens it gets alone; cancelling the chat
cancels it alone. On an engine without batching (as llama.cpp's) they take turns, as before.

The worker runs in this process (`Worker.run` on a thread, requests dispatched with `Worker.handle` as
its reader thread does) on the tiny model, so a test can hold the engine's steps (its lock) until every
request is queued, and step it by hand. The reference for every output is the same prompt generated
alone by a separate CPU engine."""

from __future__ import annotations

import os
import threading
import time

import openai
import pytest

import engine
from engine.worker import Worker
from tests.serve.conftest import KEY, request
from tests.serve.events import EventSink

CHAT = [{"role": "user", "content": "Tell me about the sea"}]
API_CHAT = [{"role": "user", "content": "Hello there"}]
API_PROMPT = "The quick brown fox"


class NoBatch:
    """The tiny engine without `submit`: it serves one generation at a time, as the llama.cpp backend."""

    submit = None

    def __init__(self, eng):
        self._engine = eng

    def __getattr__(self, name):
        return getattr(self._engine, name)


class InProcessWorker:
    def __init__(self, path, wrap=None):
        self.opened: list = []

        def opener(source, **kwargs):
            # Steps of up to 256 tokens: the first step reads every queued prompt, so all share it.
            eng = engine.open_model(source, max_step_tokens=256, **kwargs)
            self.opened.append(eng)
            return wrap(eng) if wrap else eng

        self.sink = EventSink()
        self.worker = Worker(self.sink, opener=opener, metrics_interval_s=0.05)
        read, self._write = os.pipe()
        self._infile = os.fdopen(read, "rb")
        self._thread = threading.Thread(target=self.worker.run, args=(self._infile,), daemon=True)
        self._thread.start()
        self.sink.wait_for("ready")
        self.send("load", id="load-1", source=str(path), device="cpu", backend="torch", budget=None)
        self.sink.wait_for("loaded", id="load-1")
        self.send("api_start", id="api-1", port=0, key=KEY)
        ev = self.sink.wait_for("api", id="api-1")
        assert ev["running"], ev
        self.address = ev["address"]
        self.port = int(self.address.rsplit(":", 1)[1].split("/")[0])

    @property
    def engine(self):
        return self.opened[-1]

    def send(self, type_: str, **fields) -> None:
        self.worker.handle({"type": type_, **fields})       # what the reader thread does with a line

    def close(self) -> None:
        os.close(self._write)                               # end of input: the worker shuts down
        self._thread.join(60)
        self._infile.close()
        assert not self._thread.is_alive()


@pytest.fixture
def tiny_path(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def reference(tiny_model):
    eng = engine.open_model(tiny_model("llama"), device="cpu", backend="torch", speculative=False)
    yield eng
    eng.close()


def chat_events(reference, rid: str, prompt, **params) -> list[dict]:
    """The `token` events the worker sends for `prompt` generated alone."""
    out = []
    for ev in reference.generate(prompt, **params):
        if ev.finish_reason is None:
            out.append({"type": "token", "id": rid, "text": ev.text, "token_id": ev.token_id, "index": ev.index})
        elif ev.text:
            out.append({"type": "token", "id": rid, "text": ev.text, "token_id": None, "index": ev.index})
    return out


def alone_text(reference, prompt, **params) -> str:
    return "".join(ev.text for ev in reference.generate(prompt, **params))


def api_requests(w: InProcessWorker, max_tokens: int) -> tuple[list[threading.Thread], dict]:
    """A streamed chat completion (the `openai` client) and a plain completion, each on its own thread."""
    results: dict = {}
    client = openai.OpenAI(api_key=KEY, base_url=w.address, max_retries=0, timeout=120)

    def streamed_chat():
        chunks = client.chat.completions.create(model="m", messages=API_CHAT, max_tokens=max_tokens,
                                                temperature=0, stream=True)
        results["chat"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def plain_completion():
        status, body, _ = request(w.port, "POST", "/v1/completions",
                                  {"model": "m", "prompt": API_PROMPT, "max_tokens": max_tokens, "temperature": 0})
        results["completion"] = (status, body["choices"][0]["text"])

    threads = [threading.Thread(target=f) for f in (streamed_chat, plain_completion)]
    for t in threads:
        t.start()
    return threads, results


def wait_until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def test_chat_and_api_requests_share_batched_steps(tiny_path, reference):
    w = InProcessWorker(tiny_path)
    try:
        eng = w.engine
        with eng._lock:                     # hold the steps until the chat and both API requests are queued
            w.send("generate", id="chat-1", messages=CHAT, params={"max_new_tokens": 30, "temperature": 0})
            threads, results = api_requests(w, 24)
            wait_until(lambda: eng.stats()["waiting"] == 3)
            assert w.worker._gate.waiting == 0      # nobody waits at the gate: all three hold it, shared
        done = w.sink.wait_for("done", id="chat-1")
        for t in threads:
            t.join(60)
        assert w.sink.of("chat-1") == chat_events(reference, "chat-1", CHAT, max_new_tokens=30)
        assert done["finish_reason"] == "length" and done["stats"]["generated_tokens"] == 30
        assert done["stats"]["prompt_tokens"] == len(reference.encode_prompt(CHAT))
        assert results["chat"] == alone_text(reference, API_CHAT, max_new_tokens=24)
        assert results["completion"] == (200, alone_text(reference, API_PROMPT, max_new_tokens=24))
        assert done["stats"]["max_batch_size"] == 3          # the chat and both API requests in one step
        w.send("stats", id="s")
        assert w.sink.wait_for("stats", id="s")["stats"]["max_batch_size"] == 3
    finally:
        w.close()


def test_cancelling_the_chat_leaves_the_api_requests_running(tiny_path, reference):
    w = InProcessWorker(tiny_path)
    try:
        eng = w.engine
        with eng._lock:
            w.send("generate", id="chat-1", messages=CHAT, params={"max_new_tokens": 200, "temperature": 0})
            threads, results = api_requests(w, 24)
            wait_until(lambda: eng.stats()["waiting"] == 3)
            for _ in range(4):              # the prompts, then three decode steps: all three mid-answer
                assert eng.step_batch()
            assert eng.stats()["running"] == 3
            chat = next(r for r in eng.scheduler.running if r.prompt == reference.encode_prompt(CHAT))
            n = chat.generated               # 4 (more where a step verified n-gram proposals)
            assert 4 <= n < 200
            wait_until(lambda: len(w.sink.of("chat-1")) == n)   # the chat streamed what it sampled
            w.send("cancel", id="chat-1")
        done = w.sink.wait_for("done", id="chat-1")
        for t in threads:
            t.join(60)
        assert done["finish_reason"] == "cancelled"
        got = w.sink.of("chat-1")
        sampled = [e for e in got if e["token_id"] is not None]      # (then maybe a flushed piece)
        assert len(sampled) == n == done["stats"]["generated_tokens"]
        assert sampled == chat_events(reference, "chat-1", CHAT, max_new_tokens=200)[:n]
        assert results["chat"] == alone_text(reference, API_CHAT, max_new_tokens=24)
        assert results["completion"] == (200, alone_text(reference, API_PROMPT, max_new_tokens=24))
        assert eng.stats()["max_batch_size"] == 3
        # A later chat runs in the batch as before.
        w.send("generate", id="chat-2", messages=CHAT, params={"max_new_tokens": 8, "temperature": 0})
        w.sink.wait_for("done", id="chat-2")
        assert w.sink.of("chat-2") == chat_events(reference, "chat-2", CHAT, max_new_tokens=8)
    finally:
        w.close()


def test_an_engine_without_batching_takes_turns(tiny_path, reference):
    w = InProcessWorker(tiny_path, wrap=NoBatch)
    try:
        eng = w.engine
        w.send("generate", id="chat-1", messages=CHAT, params={"max_new_tokens": 12, "temperature": 0})
        w.sink.wait_for("done", id="chat-1")
        assert w.sink.of("chat-1") == chat_events(reference, "chat-1", CHAT, max_new_tokens=12)
        # The chat holds the engine (its generation waits for the lock we hold): the API request queues.
        with eng._lock:
            w.send("generate", id="chat-2", messages=CHAT, params={"max_new_tokens": 200, "temperature": 0})
            wait_until(lambda: w.worker._current_id == "chat-2")
            threads, results = api_requests(w, 16)
            wait_until(lambda: w.worker._gate.waiting == 2)
            w.send("cancel", id="chat-2")
        done = w.sink.wait_for("done", id="chat-2")
        assert done["finish_reason"] == "cancelled" and done["stats"]["generated_tokens"] <= 1
        for t in threads:
            t.join(60)
        assert results["chat"] == alone_text(reference, API_CHAT, max_new_tokens=16)
        assert results["completion"] == (200, alone_text(reference, API_PROMPT, max_new_tokens=16))
        # A chat queued behind an API answer and cancelled there ends at once, before it starts.
        with eng._lock:
            threads, results = api_requests(w, 16)
            wait_until(lambda: w.worker._gate.waiting == 1)          # one runs (held by our lock), one waits
            w.send("generate", id="chat-3", messages=CHAT, params={"max_new_tokens": 8})
            wait_until(lambda: w.worker._gate.waiting == 2)
            w.send("cancel", id="chat-3")
            done = w.sink.wait_for("done", id="chat-3")
            assert done == {"type": "done", "id": "chat-3", "finish_reason": "cancelled",
                            "stats": {"generated_tokens": 0}}
        for t in threads:
            t.join(60)
        assert results["chat"] == alone_text(reference, API_CHAT, max_new_tokens=16)
        assert eng.stats()["batch_steps"] == 0                     # the engine's batch never ran
    finally:
        w.close()
