"""Reading the engine's rich gRPC errors: the status code and the `google.rpc.ErrorInfo` reason."""

from __future__ import annotations

from dataclasses import dataclass, fields

import grpc
from abada.engine.v1 import external_task_pb2
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_sdk.errors import LEASE_LOST_REASONS
from abada_sdk.status import RpcStatus, read_status, refused_item_status

TRANSIENT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
)
LIMIT_EXCEEDED = ErrorReason.Name(ErrorReason.LIMIT_EXCEEDED)
MODEL_QUOTA_EXHAUSTED = ErrorReason.Name(ErrorReason.MODEL_QUOTA_EXHAUSTED)
CONCURRENT_CHANGE = ErrorReason.Name(ErrorReason.CONCURRENT_CHANGE)
# The engine refused a call to a dependency that is down (the task is parked instead).
DEPENDENCY_UNAVAILABLE = ErrorReason.Name(ErrorReason.DEPENDENCY_UNAVAILABLE)


@dataclass(frozen=True)
class RpcFailure(RpcStatus):
    """A refused call as the worker decides on it: give up the lease, or wait and send it again."""

    @property
    def transient(self) -> bool:
        # RESOURCE_EXHAUSTED is back-pressure, unless the engine says a budget ran out or a model's
        # quota is used up (the task waits for that as long as it takes, not a retry budget).
        # ABORTED with CONCURRENT_CHANGE: the call met another change of the same rows and was rolled
        # back whole; sent again, it is decided afresh.
        if self.code is grpc.StatusCode.ABORTED:
            return self.reason == CONCURRENT_CHANGE
        return self.code in TRANSIENT_CODES and self.reason not in (LIMIT_EXCEEDED, MODEL_QUOTA_EXHAUSTED)

    @property
    def lease_lost(self) -> bool:
        return self.reason in LEASE_LOST_REASONS or self.code is grpc.StatusCode.NOT_FOUND


def failure_of(error: grpc.RpcError) -> RpcFailure:
    return _failure(read_status(error))


def failure_of_refusal(refusal: external_task_pb2.Refusal) -> RpcFailure:
    """One refused item of a batch call, as the failure of the single call it stands for."""
    return _failure(refused_item_status(refusal.code, refusal.message, refusal.status))


def _failure(status: RpcStatus) -> RpcFailure:
    return RpcFailure(**{part.name: getattr(status, part.name) for part in fields(status)})
