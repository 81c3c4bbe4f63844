"""The SDK's exceptions: an engine refusal carries its gRPC code and the engine's ErrorInfo reason.

Callers catch `AbadaError` (or one of its kinds) and read `.reason`, `.field` and `.violations`
instead of digging through `grpc.RpcError` trailers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from .status import RpcStatus, read_status, refused_item_status

# The engine refuses a call under a lease that is no longer the caller's with one of these reasons.
LEASE_LOST_REASONS = frozenset(
    ErrorReason.Name(reason)
    for reason in (
        ErrorReason.NOT_LEASE_HOLDER,
        ErrorReason.LEASE_EXPIRED,
        ErrorReason.TASK_NOT_LEASED,
        ErrorReason.ATTEMPT_MISMATCH,
    )
)


class AbadaError(Exception):
    """The engine (or the way to it) refused a call."""

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        reason: str = "",
        metadata: Mapping[str, str] | None = None,
        violations: list[str] | None = None,
        status: RpcStatus | None = None,
    ) -> None:
        super().__init__(f"{reason or code.name}: {message}")
        # The failed call as read, for callers that word it their own way (the `abada` CLI).
        self.status = status
        self.message = message
        self.code = code
        self.reason = reason
        self.metadata = dict(metadata or {})
        self.violations = list(violations or [])

    @property
    def field(self) -> str:
        """The request field the engine blamed, when it named one."""
        return self.metadata.get("field", "")

    @property
    def transient(self) -> bool:
        """Worth asking again later: the engine was unreachable, slow or pushing back, or the call met
        another change of the same rows at the same moment and nothing of it was written."""
        return (
            isinstance(self, EngineUnavailable)
            or (
                self.code is grpc.StatusCode.RESOURCE_EXHAUSTED
                and self.reason != ErrorReason.Name(ErrorReason.LIMIT_EXCEEDED)
            )
            or (
                self.code is grpc.StatusCode.ABORTED
                and self.reason == ErrorReason.Name(ErrorReason.CONCURRENT_CHANGE)
            )
        )


class InvalidArgument(AbadaError):
    """The request was wrong; `violations` lists every problem of a refused bundle."""


class NotFound(AbadaError):
    pass


class AlreadyExists(AbadaError):
    pass


class FailedPrecondition(AbadaError):
    """The object is not in a state that allows this (an ended instance, a resolved incident)."""


class PermissionDenied(AbadaError):
    pass


class Unauthenticated(AbadaError):
    """No token, or one the engine does not know: pass `token` / `token_file` or set ABADA_TOKEN_FILE."""


class LeaseLost(AbadaError):
    """The task's lease is no longer this worker's: it expired, or another attempt took over."""


class EngineUnavailable(AbadaError):
    """The engine could not be reached or did not answer in time."""


class InstanceFailed(AbadaError):
    """An instance being waited for stopped on an incident (or was canceled) instead of completing."""

    def __init__(self, message: str, instance: Any, incidents: list[Any]) -> None:
        super().__init__(message, code=grpc.StatusCode.FAILED_PRECONDITION, reason="INSTANCE_NOT_COMPLETED")
        self.instance = instance
        self.incidents = incidents


class TaskFailed(Exception):
    """Raised by a task handler: the attempt failed. With `retry=False` the engine raises an incident now.

    With `transient=True` something the handler needs is down (a mail server, a payment API): the
    task is offered again after a backoff (exponential with full jitter, at least
    `retry_after_seconds`) without spending one of the node's retries, until the node's
    `outage_budget` runs out (then a DEPENDENCY_UNAVAILABLE incident names `dependency`, or the topic).
    A handler's connection error or timeout (`OSError`, `TimeoutError`) counts as transient too;
    any other exception is reported as a failure with `retry=True`.
    """

    def __init__(
        self,
        message: str,
        *,
        retry: bool = True,
        code: str = "FAILED_TASK",
        details: Mapping[str, Any] | None = None,
        transient: bool = False,
        retry_after_seconds: float | None = None,
        dependency: str | None = None,
    ) -> None:
        if transient and not retry:
            raise ValueError("a failure is transient or beyond retrying, not both")
        super().__init__(message)
        self.message = message
        self.retry = retry
        self.code = code
        self.details = dict(details or {})
        self.transient = transient
        self.retry_after_seconds = retry_after_seconds
        if dependency:
            self.details["dependency"] = dependency


_KINDS: dict[grpc.StatusCode, type[AbadaError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: EngineUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: EngineUnavailable,
}


def error_from_rpc(error: grpc.RpcError) -> AbadaError:
    """The SDK exception for a failed call, with the engine's ErrorInfo and BadRequest details read out."""
    return _error_of(read_status(error))


def error_from_status(status_bytes: bytes, code: int, message: str) -> AbadaError:
    """The SDK exception for one refused item of a batch call (a serialized google.rpc.Status, as a
    failed call carries it in its trailers), read as `error_from_rpc` reads a failed call."""
    return _error_of(refused_item_status(code, message, status_bytes))


def _error_of(status: RpcStatus) -> AbadaError:
    kind = LeaseLost if status.reason in LEASE_LOST_REASONS else _KINDS.get(status.code, AbadaError)
    return kind(
        status.message,
        code=status.code,
        reason=status.reason,
        metadata=status.metadata,
        violations=status.violations,
        status=status,
    )
