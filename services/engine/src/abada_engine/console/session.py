"""The console's session: the signed-in person's caller token, sealed in a cookie.

The cookie is AES-GCM-sealed with a key derived (HKDF-SHA256, its own `info`) from a secret every
engine replica shares, so any replica opens it and nobody can read or forge it. The session holds the
token (every engine call is made with it), the roles the engine let it use, its CSRF token and when it
ends. Nothing is kept server-side: signing out clears the cookie; a token taken out of the callers file
stops working at the next engine call.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

COOKIE = "abada_console"
# The sign-in form's double-submit CSRF cookie (there is no session yet to bind it to).
SIGN_IN_COOKIE = "abada_console_signin"
SESSION_SECONDS = 8 * 3600
_INFO = b"abada-console-session-v1"
_NONCE_BYTES = 12


@dataclass(frozen=True)
class Session:
    token: str
    # What the engine let this token do when it signed in: picks the pages shown, never authorizes.
    roles: frozenset[str]
    csrf: str
    expires_at: float

    @property
    def operator(self) -> bool:
        return "operator" in self.roles

    def csrf_matches(self, sent: str) -> bool:
        return bool(sent) and hmac.compare_digest(sent.encode(), self.csrf.encode())


def session_key(secret: bytes) -> bytes:
    """The cookie key: derived for this use only, so it says nothing about the secret's other uses."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret)


class Sealer:
    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(session_key(secret))

    def new(self, token: str, roles: frozenset[str], now: float | None = None) -> Session:
        started = time.time() if now is None else now
        return Session(token, roles, secrets.token_urlsafe(24), started + SESSION_SECONDS)

    def seal(self, session: Session) -> str:
        body = json.dumps(
            {"t": session.token, "r": sorted(session.roles), "c": session.csrf, "e": session.expires_at}
        ).encode()
        nonce = os.urandom(_NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, body, COOKIE.encode())
        return base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(self, cookie: str | None, now: float | None = None) -> Session | None:
        """The session in `cookie`, or None when it is missing, altered, sealed with another key or over."""
        if not cookie or len(cookie) > 4096:
            return None
        try:
            raw = base64.urlsafe_b64decode(cookie + "=" * (-len(cookie) % 4))
            body = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], COOKIE.encode())
            data = json.loads(body)
            session = Session(str(data["t"]), frozenset(data["r"]), str(data["c"]), float(data["e"]))
        except (ValueError, KeyError, TypeError, InvalidTag):
            return None
        if session.expires_at <= (time.time() if now is None else now):
            return None
        return session
