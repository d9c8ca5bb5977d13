"""Fixtures for the API tests: a tiny model on the CPU, an API server on an ephemeral port in a thread,
the official `openai` client pointed at it, and a raw HTTP helper for requests no client would send."""

from __future__ import annotations

import http.client
import json
import socket

import pytest

KEY = "sk-slip-test-" + "k" * 24


@pytest.fixture(scope="session")
def tiny_engine(tiny_model):
    import engine

    eng = engine.open_model(tiny_model("llama"), device="cpu", backend="torch")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(tiny_engine):
    from engine.serve import ApiServer, EngineSlot

    logs: list[str] = []
    srv = ApiServer(EngineSlot(tiny_engine), KEY, port=0, log=logs.append)
    srv.start()
    srv.logs = logs
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(api_key=KEY, base_url=server.address, max_retries=0, timeout=120)


def request(port: int, method: str, path: str, body: bytes | str | dict | None = None,
            key: str | None = KEY, headers: dict | None = None) -> tuple[int, dict | None, dict]:
    """One raw HTTP request; returns (status, JSON body or None, response headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = {"Authorization": f"Bearer {key}"} if key is not None else {}
    h.update(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body)
    try:
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, (json.loads(data) if data else None), dict(resp.getheaders())
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
