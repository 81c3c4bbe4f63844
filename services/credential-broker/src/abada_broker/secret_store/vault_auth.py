"""Keeps the broker's one Vault identity alive: log in, renew before expiry, log in again when renewal fails.

Everything here is synchronous (``hvac`` is) and thread-safe: the secret store calls it from worker
threads through ``asyncio.to_thread``. Vault tokens and service-account JWTs are never logged, never put
in an exception message and never shown by a ``repr``; accessors (which Vault itself logs) are.

Failures that mean "Vault refused us" raise :class:`VaultLoginError`; transport failures
(``requests`` exceptions) and Vault server errors (``hvac`` 5xx exceptions) propagate unchanged so the
caller can report them as "Vault unavailable".
"""

from __future__ import annotations

import enum
import hashlib
import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import hvac
import hvac.exceptions

logger = logging.getLogger("abada_broker.secret_store.vault_auth")

T = TypeVar("T")

# Vault's answers to a request it refuses (as opposed to one it could not serve).
_REFUSALS = (
    hvac.exceptions.InvalidRequest,
    hvac.exceptions.Unauthorized,
    hvac.exceptions.Forbidden,
    hvac.exceptions.InvalidPath,
)
_MAX_RETRY_DELAY_SECONDS = 30.0
_MULTI_ERROR_HEADER = re.compile(r"\d+ errors? occurred:")


class VaultLoginError(Exception):
    """Vault refused to give the broker a usable token (bad role, bad or expired token, unreadable JWT)."""


@dataclass(frozen=True)
class Granted:
    """A token Vault granted, already installed on the client. Times are the keeper's clock."""

    accessor: str
    renewable: bool
    lease_seconds: float  # 0: the token never expires
    granted_at: float  # taken before the request, so expiry is never overestimated


class TokenTrouble(enum.Enum):
    """Why the keeper needs a new token although it holds one."""

    EXPIRED = "expired"
    REJECTED = "rejected"  # Vault no longer accepts it: revoked, or expired early


@dataclass(frozen=True)
class DeadToken:
    """The token the keeper holds and can no longer use: why, which one (its accessor, which Vault
    logs too), and what failed when it found out ("" when Vault's answer says it all)."""

    trouble: TokenTrouble
    accessor: str
    cause: str = ""


class AuthMethod(ABC):
    """How the broker gets its Vault token. Synchronous: called from worker threads under the keeper's lock."""

    name: ClassVar[str]
    # Whether a fresh token can be had whenever the current one is in trouble (renewal failing, maximum
    # TTL reached) by logging in again; otherwise the keeper renews what it has and warns.
    logs_in_at_will: ClassVar[bool]

    @abstractmethod
    def login(self, client: hvac.Client, clock: Callable[[], float]) -> Granted:
        """Install a token on ``client``; raises :class:`VaultLoginError` when none can be had."""

    @abstractmethod
    def login_again(self, client: hvac.Client, clock: Callable[[], float], dead: DeadToken) -> Granted:
        """Install a new token because the current one (``dead.accessor``) is dead; raises
        :class:`VaultLoginError`, saying what the operator must do, when this method cannot get one."""

    def renew(self, client: hvac.Client, clock: Callable[[], float]) -> Granted:
        """Renew the current token (Vault caps the renewal at the token's maximum TTL)."""
        started = clock()
        auth = _auth_block(client.auth.token.renew_self(), require_token=False)
        return Granted(
            accessor="",
            renewable=bool(auth.get("renewable", True)),
            lease_seconds=float(auth.get("lease_duration") or 0),
            granted_at=started,
        )


class StaticTokenAuth(AuthMethod):
    """A token handed to the broker, given directly or in a file (re-read when Vault rejects the token,
    so a Vault Agent or an operator can replace it in place). It cannot log in by itself."""

    name = "token"
    logs_in_at_will = False

    def __init__(self, *, token: str | None = None, token_file: Path | None = None) -> None:
        self._token = token
        self.token_file = token_file
        # A token known to be dead (expired or revoked), by digest, with the explanation to repeat instead
        # of asking Vault again: Vault's own answer ("invalid token") would say less.
        self._dead: tuple[bytes, str] | None = None

    def __repr__(self) -> str:
        return f"StaticTokenAuth(token_file={self.token_file!r})"

    def login(self, client: hvac.Client, clock: Callable[[], float]) -> Granted:
        token = self._configured_token()
        if self._dead is not None and self._dead[0] == _digest(token):
            raise VaultLoginError(self._dead[1])
        return self._adopt(client, token, clock)

    def login_again(self, client: hvac.Client, clock: Callable[[], float], dead: DeadToken) -> Granted:
        replacement = self._changed_token(client.token or "")
        if replacement is not None:
            return self._adopt(client, replacement, clock)
        if dead.trouble is TokenTrouble.EXPIRED:
            explanation = (
                f"the static Vault token (accessor {dead.accessor}) has expired{dead.cause}. Auth method 'token' cannot "
                "log in again: provide a new token (VAULT_TOKEN / ABADA_VAULT_TOKEN_FILE) or use kubernetes auth"
            )
        else:
            explanation = (
                f"Vault rejects the static token (accessor {dead.accessor}): it was revoked or has expired. "
                "Auth method 'token' cannot log in again: provide a new token or use kubernetes auth"
            )
        self._dead = (_digest(client.token or ""), explanation)
        client.token = ""
        raise VaultLoginError(explanation)

    def _configured_token(self) -> str:
        if self.token_file is not None:
            token = _read_token_file(self.token_file, "Vault token file")
            if token:
                return token
            if not self._token:
                raise VaultLoginError(f"the Vault token file {str(self.token_file)!r} is empty")
        if not self._token:
            raise VaultLoginError("no Vault token configured (VAULT_TOKEN or ABADA_VAULT_TOKEN_FILE)")
        return self._token

    def _changed_token(self, current: str) -> str | None:
        if self.token_file is None:
            return None
        try:
            token = self._configured_token()
        except VaultLoginError:
            return None
        return token if token != current else None

    @staticmethod
    def _adopt(client: hvac.Client, token: str, clock: Callable[[], float]) -> Granted:
        """Install a given token after asking Vault what it is (lookup-self gives TTL and renewability)."""
        previous = client.token
        client.token = token
        started = clock()
        try:
            data = client.auth.token.lookup_self()["data"]
        except _REFUSALS as error:
            client.token = previous
            raise VaultLoginError(
                "Vault rejects the configured static token (expired, revoked or mistyped?) "
                f"(HTTP {http_status_of(error)}): {vault_error_summary(error)}"
            ) from None
        except BaseException:
            client.token = previous
            raise
        granted = Granted(
            accessor=str(data.get("accessor", "")),
            renewable=bool(data.get("renewable")),
            lease_seconds=float(data.get("ttl") or 0),
            granted_at=started,
        )
        if granted.lease_seconds > 0 and not granted.renewable:
            logger.warning(
                "the static Vault token is not renewable; it expires in %.0f s and auth method 'token' cannot "
                "replace it: provide a new token before then, or use kubernetes auth",
                granted.lease_seconds,
                extra={"vault_accessor": granted.accessor},
            )
        else:
            logger.info(
                "using a static Vault token",
                extra={"vault_accessor": granted.accessor, "lease_seconds": granted.lease_seconds},
            )
        return granted


class KubernetesAuth(AuthMethod):
    """Vault's Kubernetes auth method: the pod's service-account JWT exchanged for a token, as often as needed."""

    name = "kubernetes"
    logs_in_at_will = True

    def __init__(self, *, role: str, jwt_file: Path, mount: str = "kubernetes") -> None:
        self.role = role
        self.jwt_file = jwt_file
        self.mount = mount

    def __repr__(self) -> str:
        return f"KubernetesAuth(role={self.role!r}, jwt_file={self.jwt_file!r}, mount={self.mount!r})"

    def login(self, client: hvac.Client, clock: Callable[[], float]) -> Granted:
        jwt = _read_token_file(self.jwt_file, "Kubernetes service-account token file")
        if not jwt:
            raise VaultLoginError(
                f"the Kubernetes service-account token file {str(self.jwt_file)!r} is empty"
            )
        started = clock()
        try:
            response = client.auth.kubernetes.login(
                role=self.role, jwt=jwt, use_token=False, mount_point=self.mount
            )
        except _REFUSALS as error:
            raise VaultLoginError(
                f"Vault refused the Kubernetes login for role {self.role!r} at auth/{self.mount}/login "
                f"(HTTP {http_status_of(error)}): {vault_error_summary(error)}"
            ) from None
        auth = _auth_block(response)
        client.token = auth["client_token"]
        granted = Granted(
            accessor=str(auth.get("accessor", "")),
            renewable=bool(auth.get("renewable")),
            lease_seconds=float(auth.get("lease_duration") or 0),
            granted_at=started,
        )
        logger.info(
            "logged in to Vault with kubernetes auth",
            extra={
                "vault_role": self.role,
                "vault_accessor": granted.accessor,
                "lease_seconds": granted.lease_seconds,
            },
        )
        return granted

    def login_again(self, client: hvac.Client, clock: Callable[[], float], dead: DeadToken) -> Granted:
        return self.login(client, clock)


def vault_error_summary(error: hvac.exceptions.VaultError) -> str:
    """What Vault said, without the URL or the response body: Vault's error texts never carry secret
    values, but a response body might. Go's "2 errors occurred:\n\t* a\n\t* b" becomes "a; b"."""
    messages: list[str] = []
    for raw in error.errors or []:
        text = str(raw).strip()
        if _MULTI_ERROR_HEADER.match(text):
            messages.extend(line.strip()[2:] for line in text.splitlines() if line.strip().startswith("* "))
        elif text:
            messages.append(" ".join(text.split()))
    return "; ".join(messages) or type(error).__name__


def http_status_of(error: hvac.exceptions.VaultError) -> str:
    statuses = {
        hvac.exceptions.InvalidRequest: "400",
        hvac.exceptions.Unauthorized: "401",
        hvac.exceptions.Forbidden: "403",
        hvac.exceptions.InvalidPath: "404",
        hvac.exceptions.RateLimitExceeded: "429",
        hvac.exceptions.InternalServerError: "500",
        hvac.exceptions.VaultNotInitialized: "501",
        hvac.exceptions.BadGateway: "502",
        hvac.exceptions.VaultDown: "503",
    }
    return statuses.get(type(error), "unexpected status")


@dataclass
class _Grant:
    """What the broker knows about its current token. Times are ``time.monotonic()`` seconds."""

    generation: int
    accessor: str
    renewable: bool
    lease_seconds: float  # granted at the last login/renewal; 0 means the token never expires
    granted_at: float  # taken before the request that granted it, so expiry is never overestimated
    renewal_exhausted: bool = False  # Vault will not extend it further (not renewable, or at max TTL)
    next_attempt_at: float = 0.0  # after a failed renewal/login, when to try again
    last_failure: str = ""

    @property
    def expires_at(self) -> float | None:
        return None if self.lease_seconds <= 0 else self.granted_at + self.lease_seconds

    def renew_due_at(self, renew_before_seconds: float) -> float | None:
        if self.lease_seconds <= 0:
            return None
        # A token whose whole lease is shorter than the margin would otherwise be renewed on every use.
        margin = min(renew_before_seconds, self.lease_seconds / 2)
        return self.granted_at + self.lease_seconds - margin


class VaultTokenKeeper:
    """Owns the token of one ``hvac.Client``; call Vault through :meth:`call`."""

    def __init__(
        self,
        client: hvac.Client,
        method: AuthMethod,
        *,
        renew_before_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        on_new_token: Callable[[], None] | None = None,
    ) -> None:
        """``on_new_token`` is called (from whichever thread got it) each time a new token is installed,
        so a scheduler can look at the new expiry."""
        self._client = client
        self._on_new_token = on_new_token
        self._method = method
        self._renew_before = renew_before_seconds
        self._clock = clock
        self._lock = threading.RLock()
        self._grant: _Grant | None = None
        self._generations = 0

    @property
    def auth_method_name(self) -> str:
        return self._method.name

    def call(self, operation: Callable[[hvac.Client], T]) -> T:
        """Run ``operation`` with a valid token. If Vault answers 403 because the token is no longer valid,
        get a new one and run it once more; a 403 for a valid token (a policy denial) is re-raised."""
        generation = self.ensure_token()
        try:
            return operation(self._client)
        except hvac.exceptions.Forbidden:
            if not self._recover_from_rejection(generation):
                raise
        return operation(self._client)

    def ensure_token(self) -> int:
        """Make sure a token is held and renewed when due; returns its generation. Raises only when no
        valid token can be had: a failed renewal of a still-valid token is logged and retried later."""
        with self._lock:
            now = self._clock()
            grant = self._grant
            if grant is None:
                return self._install(self._method.login(self._client, self._clock)).generation
            expires_at = grant.expires_at
            if expires_at is not None and now >= expires_at:
                cause = (
                    f"; the last renewal attempt failed: {grant.last_failure}" if grant.last_failure else ""
                )
                return self._login_again(grant, TokenTrouble.EXPIRED, cause).generation
            due_at = grant.renew_due_at(self._renew_before)
            if due_at is not None and now >= due_at and now >= grant.next_attempt_at:
                self._refresh(grant)
            if self._grant is None:
                return self._install(self._method.login(self._client, self._clock)).generation
            return self._grant.generation

    def seconds_until_due(self) -> float | None:
        """How long until :meth:`ensure_token` has work to do, or None if the token never needs any."""
        with self._lock:
            grant = self._grant
            if grant is None:
                return None
            moments: list[float] = []
            due_at = grant.renew_due_at(self._renew_before)
            # A token that can neither be renewed further nor replaced by a login only has its expiry left.
            final = grant.renewal_exhausted and not self._method.logs_in_at_will
            if due_at is not None and not final:
                moments.append(max(due_at, grant.next_attempt_at))
            if grant.expires_at is not None:
                moments.append(grant.expires_at)
            if not moments:
                return None
            return max(0.0, min(moments) - self._clock())

    def forget(self) -> None:
        with self._lock:
            self._grant = None
            self._client.token = ""

    # ---- getting a token -------------------------------------------------------------------------

    def _install(self, granted: Granted) -> _Grant:
        self._generations += 1
        self._grant = _Grant(
            generation=self._generations,
            accessor=granted.accessor,
            renewable=granted.renewable,
            lease_seconds=granted.lease_seconds,
            granted_at=granted.granted_at,
            # A token with a lifetime that cannot be renewed will only ever expire.
            renewal_exhausted=granted.lease_seconds > 0 and not granted.renewable,
        )
        if self._on_new_token is not None:
            self._on_new_token()
        return self._grant

    def _login_again(self, grant: _Grant, trouble: TokenTrouble, cause: str = "") -> _Grant:
        self._grant = None
        granted = self._method.login_again(
            self._client, self._clock, DeadToken(trouble, grant.accessor, cause)
        )
        return self._install(granted)

    # ---- keeping it ------------------------------------------------------------------------------

    def _refresh(self, grant: _Grant) -> None:
        """Renewal is due: renew, or log in afresh where the method can. The current token is still
        valid, so a failure here is logged and retried later rather than raised."""
        if grant.renewal_exhausted or not grant.renewable:
            if self._method.logs_in_at_will:
                self._login_in_advance_or_postpone(grant, reason="the token cannot be renewed further")
            return
        try:
            renewed = self._method.renew(self._client, self._clock)
        except Exception as error:  # any failure: Vault refused, Vault erred, or Vault is unreachable
            reason = _failure_text(error)
            if self._method.logs_in_at_will:
                logger.warning(
                    "Vault token renewal failed; logging in again",
                    extra={"vault_accessor": grant.accessor, "reason": reason},
                )
                self._login_in_advance_or_postpone(grant, reason=reason)
            else:
                self._postpone(grant, reason)
                logger.warning(
                    "renewal of the static Vault token failed (%s); it expires in %.1f s and auth method 'token' "
                    "cannot replace it on its own: renewal is retried, or provide a new token",
                    reason,
                    self._seconds_left(grant),
                    extra={"vault_accessor": grant.accessor},
                )
            return
        grant.lease_seconds = renewed.lease_seconds
        grant.granted_at = renewed.granted_at
        grant.renewable = renewed.renewable and grant.renewable
        grant.next_attempt_at = 0.0
        grant.last_failure = ""
        due_at = grant.renew_due_at(self._renew_before)
        # Vault caps a renewal at the token's max TTL; once the cap is reached renewing again gains nothing.
        if not grant.renewable or (due_at is not None and due_at <= self._clock() + 0.001):
            grant.renewal_exhausted = True
        logger.debug(
            "renewed the Vault token",
            extra={"vault_accessor": grant.accessor, "lease_seconds": grant.lease_seconds},
        )
        if grant.renewal_exhausted:
            if self._method.logs_in_at_will:
                self._login_in_advance_or_postpone(grant, reason="the token reached its maximum TTL")
            else:
                logger.warning(
                    "the static Vault token reached its maximum TTL and expires in %.0f s; provide a new token",
                    grant.lease_seconds,
                    extra={"vault_accessor": grant.accessor},
                )

    def _login_in_advance_or_postpone(self, grant: _Grant, *, reason: str) -> None:
        try:
            self._install(self._method.login(self._client, self._clock))
        except Exception as error:  # the old token still works for a while: keep it and try again later
            self._postpone(grant, f"{reason}; login failed too: {_failure_text(error)}")
            logger.warning(
                "Vault re-login failed; keeping the current token until it expires",
                extra={"vault_accessor": grant.accessor, "reason": grant.last_failure},
            )

    def _postpone(self, grant: _Grant, reason: str) -> None:
        grant.last_failure = reason
        delay = min(_MAX_RETRY_DELAY_SECONDS, max(0.5, self._seconds_left(grant) / 4))
        grant.next_attempt_at = self._clock() + delay

    def _seconds_left(self, grant: _Grant) -> float:
        expires_at = grant.expires_at
        return float("inf") if expires_at is None else max(0.0, expires_at - self._clock())

    def _recover_from_rejection(self, rejected_generation: int) -> bool:
        """Vault answered 403. True if a new token is now in place (worth retrying), False if the token
        is valid and the 403 is a policy denial."""
        with self._lock:
            grant = self._grant
            if grant is None or grant.generation != rejected_generation:
                return True  # another thread already replaced the token
            try:
                self._client.auth.token.lookup_self()
                return False
            except hvac.exceptions.Forbidden:
                pass
            logger.warning(
                "Vault no longer accepts the broker's token (revoked or expired early); getting a new one",
                extra={"vault_accessor": grant.accessor},
            )
            self._login_again(grant, TokenTrouble.REJECTED)
            return True


def _auth_block(response: Any, *, require_token: bool = True) -> dict[str, Any]:
    auth = response.get("auth") if isinstance(response, dict) else None
    if not isinstance(auth, dict) or (require_token and not isinstance(auth.get("client_token"), str)):
        raise VaultLoginError("Vault's answer has no usable 'auth' block")
    return auth


def _read_token_file(path: Path, what: str) -> str:
    """The file's text, stripped ("" when empty); a file that cannot be read refuses the login."""
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise VaultLoginError(
            f"cannot read the {what} {str(path)!r}: {error.strerror or type(error).__name__}"
        ) from None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _failure_text(error: BaseException) -> str:
    if isinstance(error, hvac.exceptions.VaultError):
        return f"HTTP {http_status_of(error)}: {vault_error_summary(error)}"
    if isinstance(error, VaultLoginError):
        return str(error)
    # requests' messages name the URL and the socket error, never headers or bodies.
    return f"{type(error).__name__}: {error}"[:300]
