"""The broker's answers other than a credential: one exception type carrying what the caller is told.

Every module below the gRPC layer raises :class:`BrokerError`; ``service.py`` turns it into a status with
a ``google.rpc.ErrorInfo`` (through ``abada_common.rpc_status``). A message here is sent to the caller,
so it never holds a secret, a lease token, a bearer token or anything about a secret the caller has not
been cleared to ask for.
"""

from __future__ import annotations

from collections.abc import Mapping

from abada_common.errors import Category

# What went wrong, in gRPC's vocabulary; the audit log records it in lower case.
Outcome = Category

# ErrorInfo reasons the broker answers with.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
UNAUTHENTICATED = "UNAUTHENTICATED"
MISSING_ROLE = "MISSING_ROLE"
WORKER_ID_MISMATCH = "WORKER_ID_MISMATCH"
UNKNOWN_TASK = "UNKNOWN_TASK"
NOT_LEASE_HOLDER = "NOT_LEASE_HOLDER"
LEASE_EXPIRED = "LEASE_EXPIRED"
SERVER_NOT_BOUND = "SERVER_NOT_BOUND"
CREDENTIAL_NOT_CONFIGURED = "CREDENTIAL_NOT_CONFIGURED"
CREDENTIAL_NOT_FOUND = "CREDENTIAL_NOT_FOUND"
ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"
ENGINE_REFUSED_BROKER = "ENGINE_REFUSED_BROKER"
SECRET_STORE_UNAVAILABLE = "SECRET_STORE_UNAVAILABLE"
INTERNAL = "INTERNAL"

# The engine's VerifyLease refusals, passed on to the worker unchanged.
LEASE_REFUSALS = frozenset({UNKNOWN_TASK, NOT_LEASE_HOLDER, LEASE_EXPIRED, SERVER_NOT_BOUND})


class BrokerError(Exception):
    def __init__(
        self,
        outcome: Outcome,
        reason: str,
        message: str,
        *,
        field: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.reason = reason
        self.message = message
        self.field = field
        self.metadata = dict(metadata or {})

    @property
    def retryable(self) -> bool:
        return self.outcome is Outcome.UNAVAILABLE


def invalid_argument(field: str, problem: str) -> BrokerError:
    return BrokerError(Outcome.INVALID_ARGUMENT, INVALID_ARGUMENT, f"{field} {problem}", field=field)


def unauthenticated(message: str) -> BrokerError:
    return BrokerError(Outcome.UNAUTHENTICATED, UNAUTHENTICATED, message)


def permission_denied(reason: str, message: str, **metadata: str) -> BrokerError:
    return BrokerError(Outcome.PERMISSION_DENIED, reason, message, metadata=metadata)


def failed_precondition(reason: str, message: str, **metadata: str) -> BrokerError:
    return BrokerError(Outcome.FAILED_PRECONDITION, reason, message, metadata=metadata)


def unavailable(reason: str, message: str) -> BrokerError:
    return BrokerError(Outcome.UNAVAILABLE, reason, message)


def internal(message: str = "internal error; see the broker's log") -> BrokerError:
    return BrokerError(Outcome.INTERNAL, INTERNAL, message)
