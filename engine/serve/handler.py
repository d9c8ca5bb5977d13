"""`ApiHandler`: one HTTP connection of the OpenAI-compatible API (standard library `http.server`).

Order of checks: route (404) and method (405), API key (401), body size (413), JSON (400), fields (400),
then the request waits its turn for the engine. Every refusal is a JSON error body; an unexpected
exception is logged (with its traceback) to the server's log and reaches the client as a one-line 500.
Streams are Server-Sent Events in chunked transfer encoding, ending with `data: [DONE]`.
"""

from __future__ import annotations

import json
import select
import socket
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from engine.serve.auth import bearer_token, key_matches
from engine.serve.body import has_body, parse_json_object, read_body
from engine.serve.errors import ApiError, ClientGone
from engine.serve.openai_schema import parse_chat, parse_completion
from engine.serve.responses import ResponseBuilder, model_list, usage

ROUTES = {"/v1/models": ("GET",), "/v1/chat/completions": ("POST",), "/v1/completions": ("POST",),
          "/health": ("GET",)}
_ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout", 411: "length_required", 413: "request_too_large",
                414: "uri_too_long", 431: "headers_too_large", 500: "internal_error"}


def _stopped() -> ApiError:
    return ApiError(503, "the server stopped: the answer was cut short", "server_error", code="server_stopping")


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "Slipstream-API"
    sys_version = ""
    timeout = 60                     # seconds a connection may sit idle or half-sent

    # ---- plumbing ----------------------------------------------------------------------------------
    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, False)

    def do_GET(self) -> None:
        self._dispatch()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = do_GET

    def log_message(self, format: str, *args) -> None:
        self.server.api.log(f"{self.client_address[0]} {format % args}")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's parse errors (bad request line, headers too long, unknown method) as JSON."""
        if code == HTTPStatus.NOT_IMPLEMENTED:
            code, message = 405, f"method {self.command!r} is not allowed"
        self.close_connection = True
        self._send_error(ApiError(code, message or HTTPStatus(code).phrase, code=_ERROR_CODES.get(code)))

    # ---- dispatch ----------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        self._headers_sent = False
        self._body_read = False
        try:
            self._route()
        except ClientGone:
            self.close_connection = True
        except ApiError as exc:
            if not self._body_read and (has_body(self.headers) or exc.status == 411):
                self.close_connection = True        # the unread body would be taken for the next request
            self._send_error(exc)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - logged; the client gets one line, the server serves on
            self.server.api.log("internal error:\n" + "".join(traceback.format_exception(exc)).rstrip())
            self.close_connection = True
            if not self._headers_sent:
                self._send_error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                                          code="internal_error"))

    def _route(self) -> None:
        path = unquote(urlsplit(self.path).path).rstrip("/") or "/"
        if not path.startswith("/v1/") and "/v1" + path in ROUTES and path != "/health":
            path = "/v1" + path                     # base URLs given without /v1 work too
        model_id = path[len("/v1/models/"):] if path.startswith("/v1/models/") else None
        allowed = ("GET",) if model_id else ROUTES.get(path)
        if allowed is None:
            raise ApiError(404, f"no route {self.command} {path}; the API serves /v1/chat/completions, "
                           "/v1/completions and /v1/models", code="not_found")
        if self.command not in allowed:
            raise ApiError(405, f"{self.command} {path}: method not allowed (use {', '.join(allowed)})",
                           code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
        if path == "/health":
            self._send_json(200, {"status": "ok"})
            return
        self._authorize()
        if model_id is not None:
            cards = [c for c in self.server.api.slot.model_cards() if c["id"] == model_id]
            if not cards:
                raise ApiError(404, f"model {model_id!r} is not loaded", code="model_not_found", param="model")
            self._send_json(200, cards[0])
        elif path == "/v1/models":
            self._send_json(200, model_list(self.server.api.slot.model_cards()))
        else:
            body = self._read_json()
            req = parse_chat(body) if path == "/v1/chat/completions" else parse_completion(body)
            self._complete(req)

    def _authorize(self) -> None:
        token = bearer_token(self.headers.get("Authorization"))
        if token is None:
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>' (the key is in "
                           "Slipstream's settings, or the SLIPSTREAM_API_KEY environment variable)",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not key_matches(token, self.server.api.api_key):
            raise ApiError(401, "incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    # ---- request body ------------------------------------------------------------------------------
    def _read_json(self) -> dict:
        try:
            raw = read_body(self.rfile, self.headers, self.server.api.max_body)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.timeout} s",
                           code="request_timeout") from None
        self._body_read = True
        return parse_json_object(raw)

    # ---- completions ---------------------------------------------------------------------------------
    def _complete(self, req) -> None:
        with self.server.api.slot.generation(req, abandon=self._peer_closed) as gen:
            built = ResponseBuilder(req.kind, gen.model)
            if not req.stream:
                text = "".join(gen.pieces())
                if gen.client_gone:
                    raise ClientGone()
                if gen.finish_reason == "cancelled":
                    raise _stopped()
                self._send_json(200, built.full(text, gen.finish_reason,
                                                usage(gen.prompt_tokens, gen.completion_tokens)))
                return
            self._start_stream()
            try:
                if req.kind == "chat":
                    self._sse(built.chunk("", first=True))
                for piece in gen.pieces():
                    self._sse(built.chunk(piece))
                if gen.finish_reason == "cancelled":        # only a stopping server cancels a live stream
                    self._sse(_stopped().body())
                    self._end_stream()
                    self.close_connection = True
                    return
                self._sse(built.chunk(None if req.kind == "chat" else "", gen.finish_reason))
                if req.include_usage:
                    self._sse(built.usage_chunk(usage(gen.prompt_tokens, gen.completion_tokens)))
                self._sse_raw(b"data: [DONE]\n\n")
                self._end_stream()
            except OSError:
                gen.client_gone = True                  # the slot cancels the generation on the way out
                self.close_connection = True
            except Exception as exc:  # noqa: BLE001 - headers are out: report inside the stream, then end it
                self.server.api.log("internal error mid-stream:\n" + "".join(traceback.format_exception(exc)))
                self.close_connection = True
                err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                               code="internal_error")
                try:
                    self._sse(err.body())
                    self._end_stream()
                except OSError:
                    pass

    def _peer_closed(self) -> bool:
        """True when the client has hung up (its end of the socket reads as closed)."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- responses -----------------------------------------------------------------------------------
    def _send_json(self, status: int, obj: dict, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self._headers_sent = True
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_error(self, exc: ApiError) -> None:
        try:
            self._send_json(exc.status, exc.body(), exc.headers)
        except OSError:
            self.close_connection = True

    def _start_stream(self) -> None:
        """Chunked for HTTP/1.1 (the connection stays open for the next request); HTTP/1.0 clients get
        the events unframed and the connection closed at the end."""
        self._chunked = self.request_version == "HTTP/1.1"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        if self._chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self._headers_sent = True

    def _end_stream(self) -> None:
        if self._chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _sse(self, obj: dict) -> None:
        self._sse_raw(b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                      + b"\n\n")

    def _sse_raw(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
