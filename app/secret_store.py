"""Secrets (the local API key, a Hugging Face token) in the OS keyring through `keyring`.

They are never written to the settings file. Where no keyring backend works (a headless Linux without
a Secret Service), `SecretStoreError` says so in one line and nothing is stored anywhere else.
"""

from __future__ import annotations

import secrets as _random

import keyring
import keyring.errors

from app import APP_NAME

API_KEY = "local-api-key"
HF_TOKEN = "huggingface-token"
KNOWN = (API_KEY, HF_TOKEN)


class SecretStoreError(Exception):
    """The keyring could not store or read a secret; the message is one line."""


class SecretStore:
    """Get, set and delete the app's secrets under one keyring service name."""

    def __init__(self, service: str = APP_NAME):
        self.service = service

    def get(self, name: str) -> str | None:
        self._check(name)
        try:
            return keyring.get_password(self.service, name)
        except keyring.errors.KeyringError as exc:
            raise SecretStoreError(f"OS keyring unavailable, cannot read {name} ({exc})") from exc

    def set(self, name: str, value: str) -> None:
        self._check(name)
        if not value:
            self.delete(name)
            return
        try:
            keyring.set_password(self.service, name, value)
        except keyring.errors.KeyringError as exc:
            raise SecretStoreError(f"OS keyring unavailable, {name} was not saved ({exc})") from exc

    def delete(self, name: str) -> None:
        self._check(name)
        try:
            keyring.delete_password(self.service, name)
        except keyring.errors.PasswordDeleteError:
            pass   # nothing stored: already deleted
        except keyring.errors.KeyringError as exc:
            raise SecretStoreError(f"OS keyring unavailable, cannot delete {name} ({exc})") from exc

    def ensure_api_key(self) -> str:
        """The local API key, created (random, 32 bytes) on first use."""
        key = self.get(API_KEY)
        if not key:
            key = "sk-slip-" + _random.token_urlsafe(32)
            self.set(API_KEY, key)
        return key

    def backend_name(self) -> str:
        backend = keyring.get_keyring()
        return f"{type(backend).__module__}.{type(backend).__name__}"

    @staticmethod
    def _check(name: str) -> None:
        if name not in KNOWN:
            raise ValueError(f"unknown secret {name!r}; expected one of {', '.join(KNOWN)}")
