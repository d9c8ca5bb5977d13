"""Reading a request body: `Content-Length` or chunked, capped at a size limit, parsed as one JSON object.

Errors are `ApiError`s: 411 without a length, 413 over the limit (refused before reading it), 400 for
a malformed length or chunk, bytes that are not UTF-8, text that is not JSON (NaN and Infinity
included), or JSON that is not an object. A client that stops sending mid-body is `ClientGone`.
"""

from __future__ import annotations

import json

from engine.serve.errors import ApiError, ClientGone


def is_chunked(headers) -> bool:
    return "chunked" in headers.get("Transfer-Encoding", "").lower()


def has_body(headers) -> bool:
    return is_chunked(headers) or headers.get("Content-Length", "0").strip() not in ("", "0")


def read_body(rfile, headers, limit: int) -> bytes:
    if is_chunked(headers):
        return _read_chunked(rfile, limit)
    length = headers.get("Content-Length")
    if length is None:
        raise ApiError(411, "Content-Length header required", code="length_required")
    if not length.strip().isdigit():
        raise ApiError(400, f"Content-Length={length!r}: not a number of bytes")
    n = int(length)
    if n > limit:
        raise ApiError(413, f"request body of {n} bytes is over the limit of {limit} bytes",
                       code="request_too_large")
    raw = rfile.read(n)
    if len(raw) < n:
        raise ClientGone()
    return raw


def _read_chunked(rfile, limit: int) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        line = rfile.readline(1026)
        if not line:
            raise ClientGone()
        try:
            size = int(line.split(b";")[0].strip(), 16)
        except ValueError:
            raise ApiError(400, "malformed chunked request body") from None
        if size == 0:
            while rfile.readline(1026).strip():     # trailers
                pass
            return b"".join(parts)
        total += size
        if total > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        data = rfile.read(size)
        if len(data) < size:
            raise ClientGone()
        parts.append(data)
        rfile.readline(3)


def parse_json_object(raw: bytes) -> dict:
    if not raw.strip():
        raise ApiError(400, "request body is empty: expected a JSON object")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"request body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}")
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
