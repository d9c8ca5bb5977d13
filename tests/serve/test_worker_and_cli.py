"""The API inside the app's engine worker (`api_start` / `api_stop`, sharing the loaded engine and the
chat's queue), and `python -m engine serve` as a program."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from tests.serve.conftest import KEY, free_port, request

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [{"role": "user", "content": "Hello there"}]


class WorkerProcess:
    """`python -m engine worker` driven over its JSON lines, as the app drives it."""

    def __init__(self, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine", "worker", "--metrics-interval", "5"],
                                     cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
        self.events: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            ev = json.loads(line)
            if ev["type"] != "metrics":
                self.events.put(ev)

    def send(self, type_: str, **fields) -> None:
        self.proc.stdin.write((json.dumps({"type": type_, **fields}) + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, type_: str, timeout: float = 90.0, **match) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            if ev["type"] == type_ and all(ev.get(k) == v for k, v in match.items()):
                return ev
            if ev["type"] == "error" and ev.get("kind") == "load":
                raise AssertionError(ev)

    def close(self) -> int:
        if self.proc.poll() is None:
            self.send("shutdown")
            self.proc.stdin.close()
        return self.proc.wait(30)


@pytest.fixture
def worker(tiny_model):
    w = WorkerProcess()
    w.send("load", id="load-1", source=str(tiny_model("llama")), device="cpu", backend="torch", budget=None)
    w.wait_for("loaded", id="load-1")
    yield w
    w.close()


def test_worker_serves_the_api_beside_the_chat(worker, tiny_engine):
    worker.send("api_start", id="api-1", port=0, key=KEY)
    ev = worker.wait_for("api", id="api-1")
    assert ev["running"] and ev["address"].startswith("http://127.0.0.1:") and ev["key_source"] == "the app"
    assert KEY not in json.dumps(ev)
    client = openai.OpenAI(api_key=KEY, base_url=ev["address"], max_retries=0, timeout=120)
    worker.send("generate", id="gen-1", messages=MESSAGES, params={"max_new_tokens": 30, "temperature": 0})
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0)
    done = worker.wait_for("done", id="gen-1")
    want = "".join(e.text for e in tiny_engine.generate(MESSAGES, max_new_tokens=30))
    assert r.choices[0].message.content == want and done["finish_reason"] == "length"
    assert [m.id for m in client.models.list().data] == [Path(tiny_engine.source).name]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=ev["address"], max_retries=0).models.list()
    worker.send("api_stop", id="api-2")
    assert worker.wait_for("api", id="api-2") == {"type": "api", "id": "api-2", "running": False, "address": None}
    with pytest.raises(openai.APIConnectionError):
        client.models.list()
    assert worker.close() == 0


def test_worker_api_start_on_a_busy_port_says_so(worker):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker.send("api_start", id="api-1", port=port, key=KEY)
        err = worker.wait_for("error", id="api-1")
        assert err["kind"] == "api_start" and f"127.0.0.1:{port}" in err["message"]
        ev = worker.wait_for("api", id="api-1")
        assert ev["running"] is False and ev["error"]
    worker.send("api_start", id="api-2", port=0)          # no key given: the environment's or the keyring's
    ev = worker.wait_for("api", id="api-2")
    assert ev["running"] or "keyring" in ev.get("error", "")


def test_unload_waits_for_a_running_api_answer_and_then_503(worker):
    import http.client

    worker.send("api_start", id="api-1", port=0, key=KEY)
    address = worker.wait_for("api", id="api-1")["address"]
    port = int(address.rsplit(":", 1)[1].split("/")[0])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True}),
        headers={"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert b'"role":"assistant"' in resp.readline()        # the answer has the engine now
    worker.send("unload", id="unload-1")
    rest = resp.read()                                     # it runs to its end, the unload waits
    conn.close()
    assert b'"finish_reason":"length"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    worker.wait_for("unloaded", id="unload-1")
    status, body, _ = request(port, "POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 503 and "no model is loaded" in body["error"]["message"]


def test_engine_serve_command(tiny_model):
    port = free_port()
    env = {**os.environ, "SLIPSTREAM_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(port), "--model",
                             str(tiny_model("llama")), "--device", "cpu", "--backend", "torch"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = []
        while not any(line.startswith("ready") for line in lines):
            line = proc.stdout.readline()
            assert line, (lines, proc.stderr.read())
            lines.append(line)
        out = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in out
        assert "API key: from the environment variable SLIPSTREAM_API_KEY" in out and KEY not in out
        status, body, _ = request(port, "GET", "/v1/models")
        assert status == 200 and body["data"][0]["id"] == tiny_model("llama").name
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_engine_serve_on_a_busy_port_is_one_line(tiny_model):
    import socket

    env = {**os.environ, "SLIPSTREAM_API_KEY": KEY}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engine", "serve", "--port", str(port)], check=False, cwd=ROOT,
                           capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: cannot serve the API on 127.0.0.1:")
    assert len(r.stderr.strip().splitlines()) == 1
