"""The broker's answers other than a credential: one exception type carrying what the caller is told.

Every module below the gRPC layer raises :class:`BrokerError`; ``service.py`` turns it into a status with
a ``google.rpc.ErrorInfo`` (through ``abada_common.rpc_status``). A message here is sent to the caller,
so it never holds a secret, a lease token, a bearer token or anything about a secret the caller has not
been cleared to ask for.
"""

from __future__ import annotations

from collections.abc import Mapping

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.errors import Category

# What went wrong, in gRPC's vocabulary; the audit log records it in lower case.
Outcome = Category


class BrokerError(Exception):
    def __init__(
        self,
        outcome: Outcome,
        reason: ErrorReason,
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
    def reason_name(self) -> str:
        return ErrorReason.Name(self.reason)

    @property
    def retryable(self) -> bool:
        return self.outcome is Outcome.UNAVAILABLE


def invalid_argument(field: str, problem: str) -> BrokerError:
    return BrokerError(
        Outcome.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT, f"{field} {problem}", field=field
    )


def unauthenticated(message: str) -> BrokerError:
    return BrokerError(Outcome.UNAUTHENTICATED, ErrorReason.UNAUTHENTICATED, message)


def permission_denied(reason: ErrorReason, message: str, **metadata: str) -> BrokerError:
    return BrokerError(Outcome.PERMISSION_DENIED, reason, message, metadata=metadata)


def failed_precondition(reason: ErrorReason, message: str, **metadata: str) -> BrokerError:
    return BrokerError(Outcome.FAILED_PRECONDITION, reason, message, metadata=metadata)


def unavailable(reason: ErrorReason, message: str) -> BrokerError:
    return BrokerError(Outcome.UNAVAILABLE, reason, message)


def internal(message: str = "internal error; see the broker's log") -> BrokerError:
    return BrokerError(Outcome.INTERNAL, ErrorReason.INTERNAL, message)
