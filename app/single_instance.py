"""One Slipstream at a time: the first instance listens on a local socket named after the user and the
data folder; a second one sends it "show-chat" and exits."""

from __future__ import annotations

import getpass
import hashlib

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from app import paths


def server_name() -> str:
    digest = hashlib.sha1(f"{getpass.getuser()}:{paths.data_dir()}".encode()).hexdigest()[:12]
    return f"slipstream-{digest}"


class SingleInstance(QObject):
    messageReceived = Signal(str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.name = server_name()
        self._server: QLocalServer | None = None

    def notify_running(self, message: str = "show-chat", timeout_ms: int = 500) -> bool:
        """True when another instance is running (and got `message`)."""
        sock = QLocalSocket()
        sock.connectToServer(self.name)
        if not sock.waitForConnected(timeout_ms):
            return False
        sock.write(message.encode() + b"\n")
        sock.flush()
        sock.waitForBytesWritten(timeout_ms)
        sock.disconnectFromServer()
        return True

    def listen(self) -> bool:
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        if not server.listen(self.name):
            QLocalServer.removeServer(self.name)     # a stale socket left by a crashed instance
            if not server.listen(self.name):
                return False
        server.newConnection.connect(self._accept)
        self._server = server
        return True

    def _accept(self) -> None:
        while self._server is not None and self._server.hasPendingConnections():
            sock = self._server.nextPendingConnection()
            sock.readyRead.connect(self._read)
            sock.disconnected.connect(sock.deleteLater)

    def _read(self) -> None:
        sock = self.sender()
        if not isinstance(sock, QLocalSocket):
            return
        for line in bytes(sock.readAll()).decode(errors="replace").splitlines():
            if line.strip():
                self.messageReceived.emit(line.strip())

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
