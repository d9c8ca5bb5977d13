"""Every malformed request gets a clear 4xx JSON error, never a traceback, and the server keeps serving."""

from __future__ import annotations

import base64
import socket

import openai
import pytest

from tests.serve.conftest import KEY, request

CHAT = "/v1/chat/completions"
HELLO = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def _exchange(port: int, data: bytes) -> str:
    """Send raw bytes; read the reply until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    return reply.decode()


def _still_serving(server) -> None:
    status, body, _ = request(server.port, "POST", CHAT, HELLO)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


def _error(body: dict) -> dict:
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    message = body["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    return body["error"]


@pytest.mark.parametrize("key", [None, "sk-slip-wrong", KEY + "x", ""])
def test_missing_or_wrong_key_is_401(server, key):
    for method, path, body in (("GET", "/v1/models", None), ("POST", CHAT, HELLO)):
        status, got, headers = request(server.port, method, path, body, key=key)
        assert status == 401
        assert _error(got)["code"] == "invalid_api_key"
        assert headers.get("WWW-Authenticate") == "Bearer"
    _still_serving(server)


def test_wrong_key_with_the_openai_client(server):
    bad = openai.OpenAI(api_key="nope", base_url=server.address, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=HELLO["messages"])
    _still_serving(server)


@pytest.mark.parametrize("raw", ["{not json", '{"messages": [}', "", "   ", "[1, 2]", '"text"', "\xff\xfe",
                                 '{"model": "x", "temperature": NaN, "messages": []}'])
def test_broken_json_is_400(server, raw):
    status, body, _ = request(server.port, "POST", CHAT, raw.encode("latin-1"),
                              headers={"Content-Type": "application/json"})
    assert status == 400
    assert _error(body)["type"] == "invalid_request_error"
    _still_serving(server)


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/embeddings", "/v2/chat/completions", "/v1/chat/completions/x"])
def test_unknown_route_is_404(server, path):
    status, body, _ = request(server.port, "POST", path, HELLO)
    assert status == 404 and _error(body)["code"] == "not_found"
    _still_serving(server)


@pytest.mark.parametrize("method,path", [("GET", CHAT), ("DELETE", "/v1/models"), ("PUT", "/v1/completions"),
                                         ("PATCH", CHAT), ("BREW", CHAT)])
def test_wrong_method_is_405(server, method, path):
    status, body, headers = request(server.port, method, path, HELLO)
    assert "Allow" in headers or method == "BREW"
    assert status == 405 and _error(body)["code"] == "method_not_allowed"
    _still_serving(server)


def test_prompt_over_the_context_is_400_naming_it(server, client, tiny_engine):
    long = "The quick brown fox jumps over the lazy dog. " * 60
    assert len(tiny_engine.encode_prompt(long)) > tiny_engine.context_length
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}])
    err = info.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "context" in err["message"] and str(tiny_engine.context_length) in err["message"]
    status, body, _ = request(server.port, "POST", "/v1/completions", {"prompt": long, "max_tokens": 4})
    assert status == 400 and _error(body)["code"] == "context_length_exceeded"
    _still_serving(server)


def test_n_other_than_one_is_400(server, client):
    with pytest.raises(openai.BadRequestError, match="n=2"):
        client.chat.completions.create(model="tiny", messages=HELLO["messages"], n=2)
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.completions.create(model="tiny", prompt="Hi", n=3)
    _still_serving(server)


@pytest.mark.parametrize("change,field", [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "ten"}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": True}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"stop": [1]}, "stop"),
    ({"stream": "yes"}, "stream"), ({"seed": 1.5}, "seed"), ({"model": 7}, "model"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": True}, "logprobs"),
])
def test_bad_fields_are_400_naming_the_field(server, change, field):
    status, body, _ = request(server.port, "POST", CHAT, {**HELLO, **change})
    assert status == 400, body
    assert field in _error(body)["message"]
    _still_serving(server)


def test_images_for_a_text_only_model_are_400(server, client):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
    parts = [{"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]
    with pytest.raises(openai.BadRequestError, match="text-only model"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}])
    for url, why in (("https://example.com/cat.png", "only data: URLs"), ("data:image/png;base64,@@@", "base64")):
        bad = [{"type": "image_url", "image_url": {"url": url}}]
        status, body, _ = request(server.port, "POST", CHAT, {**HELLO, "messages": [{"role": "user", "content": bad}]})
        assert status == 400 and why in _error(body)["message"]
    _still_serving(server)


def test_text_content_parts_are_joined(server, client, tiny_engine):
    parts = [{"type": "text", "text": "Hello there,"}, {"type": "text", "text": "how are you?"}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=5,
                                       temperature=0)
    want = "".join(e.text for e in tiny_engine.generate(
        [{"role": "user", "content": "Hello there,\nhow are you?"}], max_new_tokens=5))
    assert r.choices[0].message.content == want


def test_oversize_body_is_413_without_reading_it(server):
    reply = _exchange(server.port, (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                                    f"Content-Length: {server.max_body + 1}\r\n\r\n{{").encode())
    assert reply.startswith("HTTP/1.1 413") and "request_too_large" in reply
    _still_serving(server)


def test_garbage_requests_get_json_errors(server):
    reply = _exchange(server.port, b"HELLO\r\n\r\n")     # HTTP/0.9-style: no status line, by the spec
    assert '"error"' in reply and "Bad request" in reply and "<html" not in reply.lower()
    reply = _exchange(server.port, b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(120))
                      + b"\r\n")
    assert reply.startswith("HTTP/1.1 431") and '"error"' in reply and "<html" not in reply.lower()
    _still_serving(server)


def test_missing_content_length_is_411(server):
    reply = _exchange(server.port, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    assert reply.startswith("HTTP/1.1 411") and "Content-Length" in reply
    _still_serving(server)


def test_health_needs_no_key_and_says_nothing_more(server):
    status, body, _ = request(server.port, "GET", "/health", key=None)
    assert status == 200 and body == {"status": "ok"}
