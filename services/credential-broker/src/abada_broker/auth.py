"""Who is calling the broker: bearer tokens checked against a file of hashed tokens, with roles.

The file (ABADA_BROKER_AUTH_TOKENS_FILE) is YAML::

    callers:
      - identity: agent-pool
        roles: [worker]
        token_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
      - identity: abada-engine
        roles: [engine]
        token_sha256: ...

Only SHA-256 digests of the tokens are stored (``abada-broker hash-token`` prints one). An identity may
appear more than once with different tokens, which is how a token is rotated without a gap. The file is
re-read when it changes; write it atomically (write elsewhere, then rename), as Kubernetes does for a
mounted Secret. A change that does not parse is logged and ignored: the callers read last stay in force.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml
from abada.engine.v1.error_reason_pb2 import ErrorReason

from .errors import permission_denied, unauthenticated

log = logging.getLogger(__name__)

WORKER = "worker"
ENGINE = "engine"
ROLES = frozenset({WORKER, ENGINE})

_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_IDENTITY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")
_BEARER = re.compile(r"\s*bearer\s+(\S+)\s*", re.IGNORECASE)


class CallersFileError(Exception):
    """The callers file cannot be read or does not have the documented shape."""


@dataclass(frozen=True)
class Caller:
    identity: str
    roles: frozenset[str]
    # Only the insecure development mode sets this: its anonymous caller may name any worker id.
    any_worker_id: bool = False

    def has_role(self, role: str) -> bool:
        return role in self.roles

    def may_act_as(self, worker_id: str) -> bool:
        """A pool's token covers the pool itself and every worker named ``<pool>/<something>``."""
        if self.any_worker_id:
            return True
        prefix = self.identity + "/"
        return worker_id == self.identity or (worker_id.startswith(prefix) and len(worker_id) > len(prefix))

    def require_role(self, role: str) -> None:
        if not self.has_role(role):
            raise permission_denied(ErrorReason.MISSING_ROLE, f"this call needs the {role!r} role", role=role)

    def require_worker_id(self, worker_id: str) -> None:
        if not self.may_act_as(worker_id):
            raise permission_denied(
                ErrorReason.WORKER_ID_MISMATCH,
                f"worker_id must be {self.identity!r} or start with {self.identity + '/'!r} for this caller",
            )


class Callers(Protocol):
    def authenticate(self, token: str | None) -> Caller:
        """The caller presenting ``token``; raises an ErrorReason.UNAUTHENTICATED :class:`BrokerError`."""
        ...


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header, or None when there is none."""
    if not authorization:
        return None
    match = _BEARER.fullmatch(authorization)
    return match.group(1) if match else None


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    caller: Caller


def parse_callers(document: Any, where: str) -> list[_Entry]:
    """Validate a parsed callers document; messages name the entry and field, never a digest."""
    if not isinstance(document, dict) or set(document) != {"callers"}:
        raise CallersFileError(f"{where}: the file must have exactly one top-level key, 'callers'")
    raw_callers = document["callers"]
    if not isinstance(raw_callers, list):
        raise CallersFileError(f"{where}: 'callers' must be a list")
    entries: list[_Entry] = []
    seen: set[bytes] = set()
    for index, raw in enumerate(raw_callers):
        at = f"{where}: callers[{index}]"
        if not isinstance(raw, dict):
            raise CallersFileError(f"{at} must be a mapping with identity, roles and token_sha256")
        unknown = set(raw) - {"identity", "roles", "token_sha256"}
        if unknown:
            raise CallersFileError(f"{at} has unknown keys: {', '.join(sorted(map(str, unknown)))}")
        identity = raw.get("identity")
        if not isinstance(identity, str) or _IDENTITY.fullmatch(identity) is None:
            raise CallersFileError(
                f"{at}.identity must be a name of letters, digits and . _ : @ - (at most 128), "
                f"got {identity!r}"
            )
        roles = raw.get("roles")
        if not isinstance(roles, list) or not roles or not all(isinstance(role, str) for role in roles):
            raise CallersFileError(f"{at}.roles must be a non-empty list of: {', '.join(sorted(ROLES))}")
        unknown_roles = set(roles) - ROLES
        if unknown_roles:
            raise CallersFileError(
                f"{at}.roles has unknown roles {sorted(unknown_roles)}; known: {', '.join(sorted(ROLES))}"
            )
        digest_text = raw.get("token_sha256")
        if not isinstance(digest_text, str) or _HEX_DIGEST.fullmatch(digest_text.lower()) is None:
            raise CallersFileError(f"{at}.token_sha256 must be 64 hex digits (the SHA-256 of the token)")
        digest = bytes.fromhex(digest_text)
        if digest in seen:
            raise CallersFileError(
                f"{at}.token_sha256 is used by an earlier entry; every token must be unique"
            )
        seen.add(digest)
        entries.append(_Entry(digest, Caller(identity=identity, roles=frozenset(roles))))
    return entries


class TokenFileCallers:
    """Callers from the hashed-token file, re-read whenever the file changes."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int, int] | None = None
        self._entries: list[_Entry] = []
        self._reload(strict=True)

    @property
    def path(self) -> Path:
        return self._path

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: str | None) -> Caller:
        if not token:
            raise unauthenticated("no bearer token: send 'authorization: Bearer <token>'")
        self._reload(strict=False)
        digest = hashlib.sha256(token.encode("utf-8")).digest()
        found: Caller | None = None
        # Compare against every entry, so the time taken does not tell which entry (if any) matched.
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest):
                found = entry.caller
        if found is None:
            raise unauthenticated("unknown bearer token")
        return found

    def _reload(self, *, strict: bool) -> None:
        with self._lock:
            try:
                stat = os.stat(self._path)
            except OSError as error:
                if strict:
                    raise CallersFileError(
                        f"cannot read the callers file {str(self._path)!r}: {error.strerror}"
                    ) from None
                if self._seen is not None:
                    log.error(
                        "cannot read the callers file; keeping the callers read before",
                        extra={"path": str(self._path), "error": error.strerror},
                    )
                    self._seen = None
                return
            fingerprint = (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)
            if fingerprint == self._seen:
                return
            self._seen = fingerprint
            try:
                entries = self._load()
            except CallersFileError as error:
                if strict:
                    raise
                log.error("the changed callers file is invalid; keeping the callers read before: %s", error)
                return
            self._entries = entries
            log.info(
                "read the callers file",
                extra={"path": str(self._path), "callers": sorted({e.caller.identity for e in entries})},
            )

    def _load(self) -> list[_Entry]:
        where = str(self._path)
        try:
            raw = self._path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CallersFileError(f"cannot read the callers file {where!r}: {error}") from None
        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            position = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
            raise CallersFileError(f"{where}: not valid YAML{position}") from None
        return parse_callers(document, where)


class InsecureDevCallers:
    """``--insecure-dev``: everybody is accepted as worker and engine. Never for a shared machine."""

    CALLER = Caller(identity="insecure-dev", roles=ROLES, any_worker_id=True)

    def authenticate(self, token: str | None) -> Caller:
        return self.CALLER


def callers_document(callers: Iterable[tuple[str, Iterable[str], str]]) -> dict[str, Any]:
    """The callers file content for ``(identity, roles, token)`` triples; only digests are kept."""
    return {
        "callers": [
            {"identity": identity, "roles": sorted(roles), "token_sha256": hash_token(token)}
            for identity, roles, token in callers
        ]
    }
