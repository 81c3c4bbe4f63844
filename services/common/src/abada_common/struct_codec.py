"""JSON values to and from `google.protobuf.Struct`, without the number drift Struct introduces."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2

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
    compares arguments under an idempotency key would see a different request.
    """
    value: dict[str, Any] = _integral(json_format.MessageToDict(message))
    return value


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) <= _MAX_SAFE_INTEGER:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value
