"""HTTP details: chunked request bodies, keep-alive across requests (and after a refused one),
HTTP/1.0 streams, and base URLs given without /v1."""

from __future__ import annotations

import http.client
import json
import socket

from tests.serve.conftest import KEY

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def test_chunked_request_body(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    data = json.dumps(BODY).encode()
    conn.request("POST", "/v1/chat/completions", body=iter([data[:10], data[10:]]), headers=AUTH,
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 3
    conn.close()


def test_one_connection_serves_many_requests_and_survives_a_refused_one(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    for body, want in ((BODY, 200), ({**BODY, "n": 2}, 400), ({**BODY, "stream": True}, 200), (BODY, 200)):
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=AUTH)
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == want, data
        if body.get("stream"):
            assert data.rstrip().endswith(b"data: [DONE]")
    conn.request("GET", "/models", headers=AUTH)                   # without /v1 works too
    assert conn.getresponse().status == 200
    conn.close()


def test_http_1_0_stream_ends_by_closing(server):
    data = json.dumps({**BODY, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, events = reply.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"chunked" not in head.lower()
    assert events.startswith(b"data: {") and events.endswith(b"data: [DONE]\n\n")
