"""A keyring backend that keeps secrets in a dict, for tests (never the real OS keyring)."""

from __future__ import annotations

import keyring.backend
import keyring.errors


class MemoryKeyring(keyring.backend.KeyringBackend):
    priority = 1

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if (service, username) not in self.store:
            raise keyring.errors.PasswordDeleteError(username)
        del self.store[(service, username)]


class BrokenKeyring(keyring.backend.KeyringBackend):
    """Like a headless Linux without a Secret Service: every call fails."""

    priority = 1

    def get_password(self, service: str, username: str) -> str | None:
        raise keyring.errors.NoKeyringError("no recommended backend was available")

    def set_password(self, service: str, username: str, password: str) -> None:
        raise keyring.errors.NoKeyringError("no recommended backend was available")

    def delete_password(self, service: str, username: str) -> None:
        raise keyring.errors.NoKeyringError("no recommended backend was available")
