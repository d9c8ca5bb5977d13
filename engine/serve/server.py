"""`ApiServer`: the OpenAI-compatible HTTP API on a thread, bound to 127.0.0.1 by default.

    server = ApiServer(EngineSlot(engine), api_key, port=8765)
    print(server.start())        # "http://127.0.0.1:8765/v1"
    ...
    server.stop()                # cancels running generations, closes connections, frees the port

Connections get a thread each (`http.server.ThreadingHTTPServer`); generations queue at the slot's
gate (side by side in the batch of an engine that batches, else one at a time). `stop()` is safe from
any thread and more than once.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from engine.errors import SlipstreamError
from engine.serve.handler import ApiHandler
from engine.serve.runner import EngineSlot

DEFAULT_PORT = 8765
DEFAULT_MAX_BODY = 32 << 20        # 32 MiB: room for a few base64 images


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    allow_reuse_address = sys.platform != "win32"   # on Windows SO_REUSEADDR lets others steal the port

    def __init__(self, address, api: ApiServer):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.api = api
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        super().__init__(address, ApiHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks up the host's FQDN (a DNS query); the name is not needed.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def track(self, conn: socket.socket, open_: bool) -> None:
        with self._conn_lock:
            (self._connections.add if open_ else self._connections.discard)(conn)

    def close_connections(self) -> None:
        with self._conn_lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        exc = sys.exc_info()[1]
        self.api.log(f"{client_address[0]} connection error: {type(exc).__name__}: {exc}")


class ApiServer:
    def __init__(self, slot: EngineSlot, api_key: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, *,
                 max_body: int = DEFAULT_MAX_BODY, log: Callable[[str], None] | None = None):
        if not api_key:
            raise SlipstreamError("the API needs a key (none was given)")
        self.slot = slot
        self.api_key = api_key
        self.host = host
        self.port = port
        self.max_body = max_body
        self._log = log
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def log(self, line: str) -> None:
        if self._log is not None:
            with contextlib.suppress(Exception):    # logging never breaks a request
                self._log(line)

    @property
    def running(self) -> bool:
        return self._httpd is not None

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def start(self) -> str:
        """Bind and serve on a thread; returns the base URL. A port in use is a one-line error."""
        if self._httpd is not None:
            return self.address
        try:
            httpd = _HTTPServer((self.host, self.port), self)
        except OSError as exc:
            raise SlipstreamError(f"cannot serve the API on {self.host}:{self.port}: "
                                  f"{exc.strerror or exc}") from exc
        self.port = int(httpd.server_address[1])
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"api-server-{self.port}", daemon=True)
        self._thread.start()
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        self.slot.close()                 # cancel running generations, refuse queued ones
        httpd.shutdown()
        httpd.server_close()
        deadline = time.monotonic() + timeout_s
        while self.slot.active and time.monotonic() < deadline:
            time.sleep(0.02)              # cancelled answers end (and tell their clients) first
        httpd.close_connections()         # then idle keep-alive connections are closed
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def serve_until_interrupted(self) -> None:
        """Block until Ctrl-C (the CLI); then stop."""
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()
