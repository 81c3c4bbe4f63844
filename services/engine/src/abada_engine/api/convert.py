"""Translating between protobuf messages and plain Python values."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common import struct_codec
from abada_common.struct_codec import to_struct as to_struct  # the handlers' Struct codec
from google.protobuf import struct_pb2, timestamp_pb2
from google.protobuf.message import Message

from abada_engine.errors import invalid

Choice = TypeVar("Choice")

# A NUL character in JSON text: \\u0000 after an even number (or none) of other backslashes.
_NUL_IN_JSON = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def storable(values: dict[str, Any], field: str, max_bytes: int | None = None) -> dict[str, Any]:
    """`values`, which the engine stores as JSON, refused naming `field` when larger than `max_bytes`
    as JSON or holding a NUL character (PostgreSQL's jsonb cannot store one)."""
    as_json = json.dumps(values)
    if max_bytes is not None and len(as_json) > max_bytes:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, f"are larger than {max_bytes} bytes as JSON")
    if "\\u0000" in as_json and _NUL_IN_JSON.search(as_json):
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, "must not contain NUL characters (U+0000)")
    return values


def chosen(choices: Mapping[Any, Choice], value: int, field: str, expected: str) -> Choice:
    """What the enum `value` of `field` stands for; one that stands for none of `choices` (unset
    included) is refused, saying what is `expected`."""
    choice = choices.get(value)
    if choice is None:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, expected)
    return choice


def storable_text(value: str, field: str) -> str:
    if "\x00" in value:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, "must not contain NUL characters (U+0000)")
    return value


def from_struct(message: struct_pb2.Struct, field: str = "") -> dict[str, Any]:
    """The Struct as plain values (see abada_common.struct_codec); a number JSON cannot carry (NaN,
    infinity) is refused naming `field`."""
    try:
        return struct_codec.from_struct(message)
    except struct_codec.NotFinite as error:
        raise invalid(
            ErrorReason.INVALID_ARGUMENT, field, f"holds {error}, which JSON cannot carry"
        ) from None


def from_value(message: struct_pb2.Value, field: str) -> Any:
    """One Struct Value as a plain value (see `from_struct`), refused naming `field` as it does."""
    return from_struct(struct_pb2.Struct(fields={"v": message}), field)["v"]


def timestamp(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    message = timestamp_pb2.Timestamp()
    message.FromDatetime(value)
    return message


def parse_uuid(value: str, field: str) -> uuid.UUID:
    if not value:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, "is required")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, f"{value!r} is not a valid id") from None


def optional_uuid(value: str, field: str) -> uuid.UUID | None:
    return parse_uuid(value, field) if value else None


def optional_time(request: Message, field: str) -> datetime | None:
    """The request's Timestamp `field` as an aware UTC time, or None when it is not set."""
    if not request.HasField(field):
        return None
    value: timestamp_pb2.Timestamp = getattr(request, field)
    try:
        return value.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError):
        raise invalid(
            ErrorReason.INVALID_ARGUMENT, field, "is not a time between years 1 and 9999 (UTC)"
        ) from None
