"""JSON values to and from `google.protobuf.Struct`, without the number drift Struct introduces."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format, struct_pb2


def to_struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    """Struct numbers are all doubles; integral ones go back to int, as JSON does not tell them apart.

    Without this a replayed write would re-send `2.0` where the model said `2`, and a tool that
    compares arguments under an idempotency key would see a different request.
    """
    value = json_format.MessageToDict(message)
    normalized: dict[str, Any] = _integral(value)
    return normalized


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_integral(item) for item in value]
    return value
