"""One generation at a time, first come first served; a client that hangs up cancels its generation
(mid-stream, mid-answer, or while queued); stopping the server cancels what runs and frees the port."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from engine.serve.gate import GateAbandoned, GenerationGate
from tests.serve.conftest import KEY, request

CHAT = "/v1/chat/completions"
LONG = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 200,
        "temperature": 0}


class Paced:
    """The tiny engine, slowed to about 50 tokens a second so a test can hang up mid-answer. It serves
    one generation at a time (`generate`, not the engine's batch: `submit` is hidden)."""

    submit = None

    def __init__(self, engine, delay_s: float = 0.02):
        self._engine = engine
        self.delay_s = delay_s

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        events = self._engine.generate(*args, **kwargs)      # bad input raises here, as from the engine

        def paced():
            try:
                for ev in events:
                    yield ev
                    if ev.finish_reason is None:
                        time.sleep(self.delay_s)
            finally:
                events.close()
        return paced()


@pytest.fixture(scope="module")
def server(tiny_engine):
    from engine.serve import ApiServer, EngineSlot

    srv = ApiServer(EngineSlot(Paced(tiny_engine)), KEY, port=0)
    srv.start()
    yield srv
    srv.stop()


def _send(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _read_until(s: socket.socket, marker: bytes) -> bytes:
    got = b""
    while marker not in got:
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return got


def test_gate_is_first_come_first_served():
    gate = GenerationGate()
    order: list[int] = []
    gate.acquire()
    threads = []
    for i in range(4):
        t = threading.Thread(target=lambda i=i: (gate.acquire(), order.append(i), gate.release()))
        t.start()
        threads.append(t)
        assert _wait(lambda i=i: gate.waiting == i + 1)
    gate.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3] and gate.waiting == 0 and not gate.busy


def test_gate_waiter_can_give_up():
    gate = GenerationGate()
    gate.acquire()
    with pytest.raises(GateAbandoned):
        gate.acquire(abandon=lambda: True)
    assert gate.waiting == 0
    gate.release()
    with gate.hold():
        assert gate.busy


@pytest.mark.parametrize("stream", [True, False])
def test_client_hanging_up_cancels_the_generation(server, tiny_engine, stream):
    s = _send(server.port, {**LONG, "stream": stream})
    if stream:
        _read_until(s, b'"content":"')            # the first chunk
        _read_until(s, b'"content":"')            # a token or more
    else:
        assert _wait(lambda: server.slot.active == 1)
        time.sleep(0.3)
    started = time.monotonic()
    s.close()
    assert _wait(lambda: server.slot.active == 0, timeout=5.0)
    assert time.monotonic() - started < 5.0
    assert _wait(lambda: not server.slot.gate.busy)
    assert tiny_engine.stats()["generated_tokens"] < LONG["max_tokens"]
    status, _, _ = request(server.port, "POST", CHAT, {**LONG, "max_tokens": 2})
    assert status == 200


def test_a_queued_client_that_hangs_up_leaves_the_queue(server):
    first = _send(server.port, {**LONG, "stream": True})
    _read_until(first, b'"content":"')
    second = _send(server.port, {**LONG, "max_tokens": 3})
    assert _wait(lambda: server.slot.gate.waiting == 1)
    second.close()
    assert _wait(lambda: server.slot.gate.waiting == 0, timeout=3.0)
    assert server.slot.active == 1                # the first one still runs
    first.close()
    assert _wait(lambda: server.slot.active == 0)


def test_stop_cancels_running_generations_and_frees_the_port(tiny_engine):
    from engine.serve import ApiServer, EngineSlot

    srv = ApiServer(EngineSlot(Paced(tiny_engine)), KEY, port=0)
    srv.start()
    port = srv.port
    s = _send(port, {**LONG, "stream": True})
    _read_until(s, b'"content":"')
    t0 = time.monotonic()
    srv.stop()
    assert time.monotonic() - t0 < 5.0 and srv.slot.active == 0
    rest = b""
    while True:
        try:
            chunk = s.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        rest += chunk
    s.close()
    assert b"[DONE]" not in rest and b"server_stopping" in rest     # cut short, and it says so
    srv2 = ApiServer(EngineSlot(tiny_engine), KEY, port=port)   # the port is free again
    assert srv2.start().endswith(f":{port}/v1")
    srv2.stop()


def test_no_model_loaded_is_503(tiny_engine):
    from engine.serve import ApiServer, EngineSlot

    srv = ApiServer(EngineSlot(lambda: None), KEY, port=0)
    srv.start()
    try:
        status, body, _ = request(srv.port, "POST", CHAT, {**LONG, "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "model_not_loaded"
        status, body, _ = request(srv.port, "GET", "/v1/models")
        assert status == 200 and body == {"object": "list", "data": []}
    finally:
        srv.stop()


def test_a_port_in_use_is_a_one_line_error(server, tiny_engine):
    from engine.errors import SlipstreamError
    from engine.serve import ApiServer, EngineSlot

    with pytest.raises(SlipstreamError, match=f"cannot serve the API on 127.0.0.1:{server.port}"):
        ApiServer(EngineSlot(tiny_engine), KEY, port=server.port).start()
