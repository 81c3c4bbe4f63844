"""Deciding whether a caller gets a credential, and building it. No gRPC here: ``service.py`` adapts it.

A task credential goes out only after, in this order: the caller's token is known; it has the ``worker``
role; the request is well-formed; its worker id belongs to the caller; the engine confirms the live
lease and that the task's node is bound to the server. Only then is the secret read, so a refusal never
tells whether a secret exists. Every request ends in exactly one audit event.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from abada.engine.v1.error_reason_pb2 import ErrorReason

from .audit import AuditLog, AuditRecord
from .auth import ENGINE, WORKER, Callers
from .engine_client import VerifiedLease
from .errors import (
    BrokerError,
    failed_precondition,
    internal,
    invalid_argument,
    permission_denied,
    unavailable,
)
from .origins import CredentialOrigins
from .secret_store import Secret, SecretNotFound, SecretStore, SecretStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

_MAX_LENGTHS = {
    "worker_id": 256,
    "lease_token": 512,
    "server": 128,
    "credential": 128,
    "url": 2048,
    "on_behalf_of": 256,
}


class LeaseVerifier(Protocol):
    async def verify(self, task_id: str, worker_id: str, lease_token: str, server: str) -> VerifiedLease: ...


@dataclass(frozen=True)
class CallContext:
    """How the request arrived: the bearer token (None if none was sent) and the peer address."""

    token: str | None
    peer: str | None = None


@dataclass(frozen=True)
class ToolCredentialRequest:
    task_id: str
    worker_id: str
    lease_token: str
    server: str


@dataclass(frozen=True)
class IssuedCredential:
    credential: str
    secret: Secret
    expire_time: dt.datetime


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class CredentialIssuer:
    def __init__(
        self,
        *,
        callers: Callers,
        leases: LeaseVerifier,
        store: SecretStore,
        audit: AuditLog,
        max_ttl: dt.timedelta,
        origins: CredentialOrigins | None = None,
        clock: Callable[[], dt.datetime] = _utc_now,
    ) -> None:
        if max_ttl <= dt.timedelta(0):
            raise ValueError("max_ttl must be positive")
        self._callers = callers
        self._leases = leases
        self._store = store
        self._audit = audit
        self._max_ttl = max_ttl
        self._origins = origins or CredentialOrigins(None)
        self._clock = clock

    async def tool_credential(self, call: CallContext, request: ToolCredentialRequest) -> IssuedCredential:
        """The secret of ``request.server``'s credential, for the live holder of the task's lease."""
        record = AuditRecord(
            purpose="task",
            peer=call.peer,
            task_id=request.task_id,
            worker_id=request.worker_id,
            server=request.server,
        )

        async def issue() -> IssuedCredential:
            caller = self._callers.authenticate(call.token)
            record.caller = caller.identity
            caller.require_role(WORKER)
            _check_tool_request(request)
            caller.require_worker_id(request.worker_id)
            lease = await self._leases.verify(
                request.task_id, request.worker_id, request.lease_token, request.server
            )
            record.credential = lease.credential or None
            record.attempt = lease.attempt
            record.url = lease.url or None
            if not lease.credential:
                raise failed_precondition(
                    ErrorReason.CREDENTIAL_NOT_CONFIGURED,
                    f"tool server {request.server!r} has no credential in the task's definition",
                )
            self._origins.check(lease.credential, lease.url)
            secret = await self._read(lease.credential)
            record.version = secret.version
            now = self._clock()
            expire_time = min(lease.expires_at, now + self._max_ttl)
            if expire_time <= now:
                # The lease ran out while the secret was being read.
                raise permission_denied(ErrorReason.LEASE_EXPIRED, "the lease on this task has expired")
            return IssuedCredential(credential=lease.credential, secret=secret, expire_time=expire_time)

        issued = await self._audited(record, issue)
        self._audit.issued(record, expire_time=issued.expire_time)
        return issued

    async def deploy_credential(
        self, call: CallContext, credential: str, server: str, url: str, on_behalf_of: str
    ) -> Secret:
        """For the engine's deploy-time contract check: the secret of ``credential``, engine role only.

        Only for a ``url`` whose origin the credential is bound to; ``on_behalf_of`` (the deploying
        operator, as the engine authenticated them) goes into the audit trail beside the engine.
        """
        record = AuditRecord(
            purpose="deploy",
            peer=call.peer,
            server=server,
            credential=credential,
            url=url or None,
            on_behalf_of=on_behalf_of or None,
        )

        async def issue() -> Secret:
            caller = self._callers.authenticate(call.token)
            record.caller = caller.identity
            caller.require_role(ENGINE)
            _require_text("credential", credential)
            _require_text("server", server)
            _require_text("url", url)
            _require_text("on_behalf_of", on_behalf_of)
            self._origins.check(credential, url)
            secret = await self._read(credential)
            record.version = secret.version
            return secret

        secret = await self._audited(record, issue)
        self._audit.issued(record, expire_time=None)
        return secret

    async def _audited(self, record: AuditRecord, issue: Callable[[], Awaitable[T]]) -> T:
        try:
            return await issue()
        except BrokerError as error:
            self._audit.refused(record, error)
            raise
        except Exception:
            log.exception("unexpected failure while issuing a credential")
            refusal = internal()
            self._audit.refused(record, refusal)
            raise refusal from None

    async def _read(self, credential: str) -> Secret:
        try:
            return await self._store.read(credential)
        except SecretNotFound:
            raise failed_precondition(
                ErrorReason.CREDENTIAL_NOT_FOUND,
                f"credential {credential!r} has no value in the secret store",
                credential=credential,
            ) from None
        except SecretStoreError as error:
            # The store's messages are written to be safe to log (no values, no tokens); the caller gets
            # none of it: not the store's address, not why.
            log.warning(
                "the secret store could not serve a read",
                extra={"credential": credential, "error_type": type(error).__name__, "detail": str(error)},
            )
            raise unavailable(
                ErrorReason.SECRET_STORE_UNAVAILABLE, "the secret store is unavailable; try again later"
            ) from None


def _require_text(field: str, value: str) -> None:
    if not value:
        raise invalid_argument(field, "is required")
    limit = _MAX_LENGTHS.get(field)
    if limit is not None and len(value) > limit:
        raise invalid_argument(field, f"must be at most {limit} characters")


def _check_tool_request(request: ToolCredentialRequest) -> None:
    if not request.task_id:
        raise invalid_argument("task_id", "is required")
    try:
        uuid.UUID(request.task_id)
    except ValueError:
        raise invalid_argument("task_id", "is not a valid id") from None
    _require_text("worker_id", request.worker_id)
    _require_text("lease_token", request.lease_token)
    _require_text("server", request.server)
