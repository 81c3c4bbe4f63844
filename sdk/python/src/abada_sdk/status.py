"""Reading a failed call: its code, message and the rich details the server put in the
`grpc-status-details-bin` trailer (`ErrorInfo` reason and metadata, `RetryInfo`, `BadRequest`).

Every Abada client reads refusals here: the SDK's exceptions, the CLI, the agent worker and the broker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import grpc
from google.rpc import code_pb2, error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"

_GRPC_CODES: dict[int, grpc.StatusCode] = {getattr(code_pb2, code.name): code for code in grpc.StatusCode}


@dataclass(frozen=True)
class RpcStatus:
    """A failed call as the caller sees it, with the rich details read out where they could be."""

    code: grpc.StatusCode
    message: str
    # From ErrorInfo; empty when the status carried none (the transport's own, or unreadable).
    reason: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    # From RetryInfo: when the server says asking again makes sense.
    retry_after_seconds: float | None = None
    # From BadRequest: every problem of a refused request, as a person reads it.
    violations: list[str] = field(default_factory=list)
    # True when an ErrorInfo was found: the server's own checks refused, not the transport.
    has_error_info: bool = False

    @property
    def field(self) -> str:
        """The request field the server blamed, when it named one."""
        return self.metadata.get("field", "")


def read_status(error: grpc.RpcError) -> RpcStatus:
    """The code, message and details of a failed call.

    A malformed trailer (bytes that are no `google.rpc.Status`, a detail of another type, one that does
    not unpack) is skipped: it must never hide the status itself.
    """
    code = error.code()
    message = error.details() or code.name
    # types-grpcio types each trailer as a `_Metadatum` with attributes; at run time, sync and aio calls
    # alike give (key, value) pairs, as gRPC documents them.
    trailers = cast(Iterable[tuple[str, str | bytes]], error.trailing_metadata() or ())
    return status_from_trailers(code, message, trailers)


def status_from_trailers(
    code: grpc.StatusCode, message: str, trailers: Iterable[tuple[str, str | bytes]]
) -> RpcStatus:
    info: error_details_pb2.ErrorInfo | None = None
    retry_after: float | None = None
    violations: list[str] = []
    for key, value in trailers:
        if key != DETAILS_KEY or not isinstance(value, bytes):
            continue
        try:
            details = list(status_pb2.Status.FromString(value).details)
        except Exception:  # not a google.rpc.Status at all
            continue
        for detail in details:
            try:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    unpacked = error_details_pb2.ErrorInfo()
                    if detail.Unpack(unpacked):
                        info = unpacked
                elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    retry = error_details_pb2.RetryInfo()
                    if detail.Unpack(retry):
                        retry_after = retry.retry_delay.ToMilliseconds() / 1000
                elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    bad_request = error_details_pb2.BadRequest()
                    if detail.Unpack(bad_request):
                        violations.extend(v.description or v.field for v in bad_request.field_violations)
            except Exception:  # a detail whose bytes do not decode as its declared type
                continue
    if info is None:
        return RpcStatus(code, message, retry_after_seconds=retry_after, violations=violations)
    return RpcStatus(
        code,
        message,
        info.reason,
        dict(info.metadata),
        retry_after,
        violations,
        has_error_info=True,
    )


def refused_item_status(code: int, message: str, status: bytes) -> RpcStatus:
    """One refused item of a batch call (its google.rpc code, message and serialized google.rpc.Status),
    read as the failed single call it stands for."""
    status_code = _GRPC_CODES.get(code, grpc.StatusCode.UNKNOWN)
    return status_from_trailers(status_code, message or status_code.name, [(DETAILS_KEY, status)])
