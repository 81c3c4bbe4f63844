"""Refusals as rich gRPC statuses: a `google.rpc.Status` with `ErrorInfo` (domain abada.dev, the
reason, `field` and other metadata), `RetryInfo` and `BadRequest` in the `grpc-status-details-bin`
trailer. Reading one back from a failed call is the clients' side: `abada_sdk.status`.

Only gRPC-facing code imports this module (handlers, clients); the domain raises its own exceptions
with a `Category` from `abada_common.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
