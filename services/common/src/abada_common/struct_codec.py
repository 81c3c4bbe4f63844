"""JSON values to and from `google.protobuf.Struct`, without the number drift Struct introduces."""

from __future__ import annotations

import math
from typing import Any

from google.protobuf import struct_pb2

# Past 2**53 a double no longer holds every whole number: such a value stays the float it arrived as.
_MAX_SAFE_INTEGER = 2**53


def to_struct(value: dict[str, Any] | None) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    if value:
        message.update(value)
    return message


def from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    """Struct numbers are all doubles; integral ones go back to int, as JSON does not tell them apart.

    Without this a replayed write would re-send `2.0` where the model said `2`, and a tool that
    compares arguments under an idempotency key would see a different request. The Struct is walked
    directly: what json_format.MessageToDict then the int pass gave, at about half the cost (every
    journal step and completion passes through here). A NaN or infinity, which JSON cannot carry,
    raises NotFinite (MessageToDict raised ValueError too).
    """
    return {key: _plain(value) for key, value in message.fields.items()}


class NotFinite(ValueError):
    """A Struct number that JSON cannot carry (NaN, infinity)."""


def _plain(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return value.string_value
    if kind == "number_value":
        number = value.number_value
        if not math.isfinite(number):
            raise NotFinite(f"the number {number}")
        return int(number) if number.is_integer() and abs(number) <= _MAX_SAFE_INTEGER else number
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {key: _plain(item) for key, item in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_plain(item) for item in value.list_value.values]
    return None
