"""Translating between protobuf messages and plain Python values."""

from __future__ import annotations

import uuid
from datetime import datetime

from abada_common.struct_codec import from_struct as from_struct  # the handlers' Struct codec
from abada_common.struct_codec import to_struct as to_struct
from google.protobuf import timestamp_pb2

from abada_engine.errors import invalid


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
