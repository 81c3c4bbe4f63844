"""Translating between protobuf messages and plain Python values."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from google.protobuf import json_format, struct_pb2, timestamp_pb2

from abada_engine.errors import invalid

_MAX_SAFE_INTEGER = 2**53


def _integral(value: Any) -> Any:
    """Struct carries every number as a double; give whole numbers back their int type."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_SAFE_INTEGER:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    return _integral(json_format.MessageToDict(message))


def to_struct(value: dict[str, Any] | None) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    if value:
        message.update(value)
    return message


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


def parse_uuid(value: str, field: str) -> uuid.UUID:
    if not value:
        raise invalid("INVALID_ARGUMENT", field, "is required")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise invalid("INVALID_ARGUMENT", field, f"{value!r} is not a valid id") from None


def optional_uuid(value: str, field: str) -> uuid.UUID | None:
    return parse_uuid(value, field) if value else None
