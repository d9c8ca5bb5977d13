"""The API key: from SLIPSTREAM_API_KEY, else the OS keyring entry the app uses (created on first use);
checked in constant time."""

from __future__ import annotations

import keyring
import pytest

from engine.errors import SlipstreamError
from engine.serve import auth
from tests.app.memory_keyring import BrokenKeyring, MemoryKeyring


@pytest.fixture
def memory_keyring(monkeypatch):
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def test_the_app_and_the_server_use_the_same_keyring_entry(memory_keyring):
    from app import APP_NAME
    from app.secret_store import API_KEY, SecretStore

    assert (auth.KEYRING_SERVICE, auth.KEYRING_USER) == (APP_NAME, API_KEY)
    key, where = auth.resolve_api_key()
    assert key.startswith("sk-slip-") and len(key) > 40 and "created now" in where
    assert SecretStore().get(API_KEY) == key                     # the app sees the key the server made
    assert auth.resolve_api_key() == (key, where.replace(", created now", ""))
    SecretStore().set(API_KEY, "sk-slip-from-the-app")
    assert auth.resolve_api_key()[0] == "sk-slip-from-the-app"


def test_the_environment_wins(memory_keyring, monkeypatch):
    monkeypatch.setenv(auth.ENV_VAR, "env-key")
    assert auth.resolve_api_key() == ("env-key", "the environment variable SLIPSTREAM_API_KEY")
    assert memory_keyring.store == {}


def test_no_keyring_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv(auth.ENV_VAR, raising=False)
    previous = keyring.get_keyring()
    keyring.set_keyring(BrokenKeyring())
    try:
        with pytest.raises(SlipstreamError, match="set the environment variable SLIPSTREAM_API_KEY") as info:
            auth.resolve_api_key()
        assert "\n" not in str(info.value)
    finally:
        keyring.set_keyring(previous)


def test_bearer_parsing_and_comparison():
    assert auth.bearer_token("Bearer abc") == "abc"
    assert auth.bearer_token("bearer  abc ") == "abc"
    assert auth.bearer_token("Basic abc") is None and auth.bearer_token("Bearer ") is None
    assert auth.bearer_token(None) is None
    assert auth.key_matches("abc", "abc") and not auth.key_matches("abd", "abc")
    assert not auth.key_matches("ab", "abc") and not auth.key_matches(None, "abc")
    assert not auth.key_matches("ключ", "abc")                 # non-ASCII input is compared, not an error
