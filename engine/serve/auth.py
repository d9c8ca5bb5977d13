"""The local API's key: where it comes from, and the constant-time check of `Authorization: Bearer KEY`.

The key is the environment variable `SLIPSTREAM_API_KEY` where set (headless use, tests), else the OS
keyring entry the app uses too (service "Slipstream", user "local-api-key"; `app/secret_store.py` keeps
the same names), created at random and stored there on first use. The key itself is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from engine.errors import SlipstreamError

ENV_VAR = "SLIPSTREAM_API_KEY"
KEYRING_SERVICE = "Slipstream"       # app.APP_NAME
KEYRING_USER = "local-api-key"       # app.secret_store.API_KEY
KEY_PREFIX = "sk-slip-"


def new_key() -> str:
    """A fresh random key (32 random bytes), in the app's format."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def resolve_api_key(create: bool = True) -> tuple[str, str]:
    """Return (key, where it came from). Raises a one-line `SlipstreamError` when there is none."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return env, f"the environment variable {ENV_VAR}"
    where = f'the OS keyring (service "{KEYRING_SERVICE}", user "{KEYRING_USER}")'
    try:
        import keyring
        import keyring.errors

        key = keyring.get_password(KEYRING_SERVICE, KEYRING_USER)
        if key:
            return key, where
        if not create:
            raise SlipstreamError(f"no API key: set {ENV_VAR} or store one in {where}")
        key = new_key()
        keyring.set_password(KEYRING_SERVICE, KEYRING_USER, key)
        return key, f"{where}, created now"
    except SlipstreamError:
        raise
    except Exception as exc:
        raise SlipstreamError(f"no API key: the OS keyring is unavailable ({type(exc).__name__}: {exc}); "
                              f"set the environment variable {ENV_VAR}") from exc


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison: the time depends neither on where the keys differ nor on the length of
    the expected key (both sides are hashed to 32 bytes first)."""
    if given is None:
        return False
    a = hashlib.sha256(given.encode("utf-8", "surrogatepass")).digest()
    b = hashlib.sha256(expected.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(a, b)
