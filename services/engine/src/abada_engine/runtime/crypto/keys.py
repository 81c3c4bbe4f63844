"""Sealing journal payloads (AES-256-GCM under a key ring) and deriving idempotency keys (HMAC-SHA256).

The key ring is `ABADA_JOURNAL_KEYS="id2:BASE64,id1:BASE64"`: the first key seals new rows, every
key opens rows sealed under it, so a new key is rotated in by putting it first. Each row records
its key id; what a ciphertext is bound to (its associated data) is decided by `sealing`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import pathlib
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from abada_engine.private_files import write_private

log = logging.getLogger(__name__)

NONCE_BYTES = 12


class JournalIntegrityError(Exception):
    """A sealed payload failed authentication: altered ciphertext, associated data or key."""


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class KeyRing:
    keys: dict[str, bytes]
    primary: str
    # Built once per key, not per payload: its AES-GCM cipher and the HMAC key of its digests.
    _ciphers: dict[str, AESGCM] = field(init=False, repr=False, compare=False)
    _digest_keys: dict[str, bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ciphers", {key_id: AESGCM(key) for key_id, key in self.keys.items()})
        object.__setattr__(
            self,
            "_digest_keys",
            {
                key_id: hmac.new(key, b"abada.journal.digest", hashlib.sha256).digest()
                for key_id, key in self.keys.items()
            },
        )

    @staticmethod
    def parse(text: str) -> KeyRing:
        keys: dict[str, bytes] = {}
        order: list[str] = []
        for entry in filter(None, (part.strip() for part in text.split(","))):
            key_id, sep, encoded = entry.partition(":")
            if not sep or not key_id:
                raise ValueError("ABADA_JOURNAL_KEYS entries are id:base64key")
            try:
                key = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise ValueError(f"journal key {key_id!r} is not valid base64") from None
            if len(key) != 32:
                raise ValueError(f"journal key {key_id!r} must be 32 bytes (AES-256), not {len(key)}")
            if key_id in keys:
                raise ValueError(f"journal key id {key_id!r} is listed twice")
            keys[key_id] = key
            order.append(key_id)
        if not keys:
            raise ValueError("ABADA_JOURNAL_KEYS names no key")
        return KeyRing(keys, order[0])

    def seal(self, key_id: str, plaintext: bytes, aad: bytes) -> bytes:
        """Seal under `key_id`, bound to the associated data `aad`."""
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise JournalIntegrityError(f"journal key {key_id!r} is not in the key ring")
        nonce = os.urandom(NONCE_BYTES)
        return nonce + cipher.encrypt(nonce, plaintext, aad)

    def open(self, key_id: str, blob: bytes, aad: bytes) -> bytes:
        """The plaintext of a payload sealed under `key_id` with associated data `aad`."""
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise JournalIntegrityError(f"journal key {key_id!r} is not in the key ring")
        try:
            return cipher.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
        except InvalidTag:
            raise JournalIntegrityError("failed authentication (altered or misplaced)") from None

    def digest(self, key_id: str, value: Any) -> bytes:
        """A keyed digest of a payload, to recognise an identical re-send without decrypting."""
        digest_key = self._digest_keys.get(key_id)
        if digest_key is None:
            # Never fall back to another key: a digest under the wrong key would call a re-send different.
            raise JournalIntegrityError(f"journal key {key_id!r} is not in the key ring")
        return hmac.digest(digest_key, canonical(value), "sha256")


@dataclass(frozen=True)
class IdempotencyKeys:
    secret: bytes

    def key(self, task_id: uuid.UUID, attempt: int, sequence: int) -> str:
        mac = hmac.new(self.secret, f"{task_id}|{attempt}|{sequence}".encode(), hashlib.sha256).hexdigest()
        return f"abada-{mac}"


def dev_secret_file(path: pathlib.Path, make: Any) -> str:
    """Read a development secret kept in the state directory, creating it on first use."""
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    value = make()
    write_private(path, value + "\n")
    log.warning("generated a development secret; set the real one in production", extra={"path": str(path)})
    return value


def journal_keys_from_env(env: dict[str, str], state_dir: pathlib.Path) -> KeyRing:
    text = env.get("ABADA_JOURNAL_KEYS")
    if not text:
        text = dev_secret_file(
            state_dir / "journal-keys",
            lambda: f"dev-{secrets.token_hex(4)}:{base64.b64encode(os.urandom(32)).decode()}",
        )
    return KeyRing.parse(text)


# An HMAC key shorter than this can be guessed offline from the keys tool servers see.
MIN_IDEMPOTENCY_SECRET_BYTES = 32


def idempotency_from_env(env: dict[str, str], state_dir: pathlib.Path) -> IdempotencyKeys:
    """The idempotency HMAC secret; raises ValueError for one shorter than 32 bytes."""
    text = env.get("ABADA_IDEMPOTENCY_SECRET") or dev_secret_file(
        state_dir / "idempotency-secret", lambda: secrets.token_urlsafe(32)
    )
    if len(text.encode()) < MIN_IDEMPOTENCY_SECRET_BYTES:
        raise ValueError(
            f"ABADA_IDEMPOTENCY_SECRET must be at least {MIN_IDEMPOTENCY_SECRET_BYTES} bytes "
            "(for instance 32 random bytes, base64-encoded)"
        )
    return IdempotencyKeys(text.encode())
