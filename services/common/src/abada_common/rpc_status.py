"""Refusals as rich gRPC statuses, both ways: a `google.rpc.Status` with `ErrorInfo` (domain abada.dev,
the reason, `field` and other metadata), `RetryInfo` and `BadRequest` in the `grpc-status-details-bin`
trailer; and reading one back from a failed call.

Only gRPC-facing code imports this module (handlers, clients); the domain raises its own exceptions
with a `Category` from `abada_common.errors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import code_pb2, error_details_pb2, status_pb2

from .errors import (
    MAX_DETAILS_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_METADATA_KEY_BYTES,
    MAX_METADATA_VALUE_BYTES,
    MAX_VIOLATION_BYTES,
    Category,
    bounded,
)

DOMAIN = "abada.dev"
DETAILS_KEY = "grpc-status-details-bin"

CODES: dict[Category, grpc.StatusCode] = {category: grpc.StatusCode[category.name] for category in Category}


@dataclass(frozen=True)
class Violation:
    """One offending field of a refused request (a `BadRequest.FieldViolation`)."""

    field: str
    description: str


def status_message(
    category: Category,
    reason: str,
    message: str,
    *,
    field: str = "",
    metadata: Mapping[str, str] | None = None,
    retry_after_seconds: float | None = None,
    violations: Sequence[Violation] = (),
) -> status_pb2.Status:
    """A refusal as a `google.rpc.Status`, its message bounded, with its details packed."""
    code = CODES[category]
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN)
    if field:
        info.metadata["field"] = bounded(field, MAX_METADATA_VALUE_BYTES)
    for key, value in (metadata or {}).items():
        info.metadata[bounded(key, MAX_METADATA_KEY_BYTES)] = bounded(value, MAX_METADATA_VALUE_BYTES)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=bounded(message, MAX_MESSAGE_BYTES))
    _pack(status, info)
    if retry_after_seconds is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(max(0, round(retry_after_seconds * 1000)))
        _pack(status, retry)
    if violations:
        _pack(status, _bad_request(violations, MAX_DETAILS_BYTES - status.ByteSize()))
    return status


async def abort(context: grpc.aio.ServicerContext[Any, Any], status: status_pb2.Status) -> None:
    """Ends the call with the refusal `status` (see `status_message`); raises, as
    `ServicerContext.abort` does."""
    await context.abort(
        _GRPC_CODES[status.code],
        status.message,
        trailing_metadata=((DETAILS_KEY, status.SerializeToString()),),
    )


_GRPC_CODES: dict[int, grpc.StatusCode] = {getattr(code_pb2, code.name): code for code in grpc.StatusCode}


def _pack(status: status_pb2.Status, detail: Message) -> None:
    packed = any_pb2.Any()
    packed.Pack(detail)
    status.details.append(packed)


def _bad_request(violations: Sequence[Violation], budget: int) -> error_details_pb2.BadRequest:
    """Every violation while they fit in `budget` bytes, then one line saying how many more there are."""
    bad_request = error_details_pb2.BadRequest()
    for index, violation in enumerate(violations):
        entry = error_details_pb2.BadRequest.FieldViolation(
            field=bounded(violation.field, MAX_METADATA_VALUE_BYTES),
            description=bounded(violation.description, MAX_VIOLATION_BYTES),
        )
        if bad_request.ByteSize() + entry.ByteSize() + 120 > budget:
            left = len(violations) - index
            bad_request.field_violations.add(
                field="", description=f"… and {left} more problem{'s' if left != 1 else ''}, not shown"
            )
            break
        bad_request.field_violations.append(entry)
    return bad_request


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
