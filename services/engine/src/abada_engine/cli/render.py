"""Output primitives: aligned columns, JSON of protobuf messages, times, ages and short summaries."""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from abada_sdk.models import plain_numbers
from google.protobuf import json_format, timestamp_pb2
from google.protobuf.message import Message

EMPTY = "-"
ELLIPSIS = "…"


_GAP = 2
# Ids are what a person copies into the next command: they are never cut.
_UNCUT = frozenset({"ID", "INSTANCE", "TASK", "DEFINITION", "INCIDENT"})
_NARROWEST = 6


def terminal_width() -> int | None:
    """COLUMNS when set, else the terminal's width; None when writing to a pipe or a file (no limit)."""
    configured = os.environ.get("COLUMNS", "")
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def table(
    headers: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    drop: Sequence[str] = (),
    width: int | None = None,
) -> str:
    """Plain columns two spaces apart, fitted to the terminal's width.

    Too wide, the widest cells are cut first (ids never); if that is not enough, the columns named in
    `drop` go, in that order. Written to a pipe nothing is cut, so output stays greppable.
    """
    limit = width if width is not None else terminal_width()
    kept = list(headers)
    lines = [list(headers), *(list(row) for row in rows)]
    widths, fits = _fit(kept, lines, limit)
    for name in drop:
        if fits or name not in kept:
            continue
        column = kept.index(name)
        kept.pop(column)
        lines = [line[:column] + line[column + 1 :] for line in lines]
        widths, fits = _fit(kept, lines, limit)
    rendered = [
        "  ".join(shorten(cell, width).ljust(width) for cell, width in zip(line, widths, strict=True))
        for line in lines
    ]
    return "\n".join(line.rstrip() for line in rendered)


def _fit(headers: list[str], lines: list[list[str]], limit: int | None) -> tuple[list[int], bool]:
    """Column widths within `limit`, narrowing the widest cuttable column step by step; False if they
    cannot fit (the widths are then as narrow as allowed)."""
    widths = [max(len(line[column]) for line in lines) for column in range(len(headers))]
    if limit is None:
        return widths, True
    floors = [
        widths[i] if name in _UNCUT else min(widths[i], max(len(name), _NARROWEST))
        for i, name in enumerate(headers)
    ]
    excess = sum(widths) + _GAP * (len(widths) - 1) - limit
    while excess > 0:
        candidates = [i for i in range(len(widths)) if widths[i] > floors[i]]
        if not candidates:
            return widths, False
        widest = max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1
    return widths, True


def fields(pairs: Sequence[tuple[str, str]], indent: str = "") -> str:
    """A key/value card: keys in one column, values (even multi-line ones) in the next."""
    width = max(len(key) for key, _ in pairs)
    continuation = "\n" + " " * (len(indent) + width + 2)
    lines = []
    for key, value in pairs:
        aligned = continuation.join(value.splitlines()) or value
        lines.append(f"{indent}{key.ljust(width)}  {aligned}")
    return "\n".join(lines)


def message_dict(message: Message) -> dict[str, Any]:
    """The message as JSON values of its own types: every field, zero ones too; 64-bit integers as
    numbers, not strings; enum values as the words the flags take (`active`, not `INSTANCE_STATE_ACTIVE`)."""
    data = json_format.MessageToDict(
        message,
        preserving_proto_field_name=False,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return plain_numbers(_enum_words(message, data))


# Enums whose values a flag takes as they are (`abada incidents --reason DEPENDENCY_UNAVAILABLE`).
_ENUMS_AS_NAMED = frozenset({"IncidentType"})
_OPAQUE = frozenset({"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"})


def enum_word(enum_type: Any, number: int) -> str:
    """`INSTANCE_STATE_ACTIVE` of InstanceState as `active`: the value without its enum's prefix, lower case."""
    value = enum_type.values_by_number.get(number)
    if value is None:
        return str(number)
    if enum_type.name in _ENUMS_AS_NAMED:
        return str(value.name)
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", enum_type.name).upper() + "_"
    return str(value.name.removeprefix(prefix).lower())


def _enum_words(message: Message, data: dict[str, Any]) -> dict[str, Any]:
    for field in message.DESCRIPTOR.fields:
        key = field.json_name
        if key not in data:
            continue
        value = getattr(message, field.name)
        repeated = field.is_repeated
        if field.enum_type is not None:
            data[key] = (
                [enum_word(field.enum_type, v) for v in value]
                if repeated
                else enum_word(field.enum_type, value)
            )
            continue
        message_type = field.message_type
        if message_type is None or message_type.full_name in _OPAQUE:
            continue
        if message_type.GetOptions().map_entry:
            value_field = message_type.fields_by_name["value"]
            if value_field.enum_type is not None:
                data[key] = {k: enum_word(value_field.enum_type, v) for k, v in value.items()}
            elif value_field.message_type is not None and value_field.message_type.full_name not in _OPAQUE:
                data[key] = {k: _enum_words(value[k], data[key][k]) for k in value}
            continue
        if repeated:
            data[key] = [_enum_words(item, part) for item, part in zip(value, data[key], strict=True)]
        elif isinstance(data[key], dict):
            data[key] = _enum_words(value, data[key])
    # In the order the proto declares them, set or not (MessageToDict puts the unset ones last).
    ordered = {
        field.json_name: data[field.json_name]
        for field in message.DESCRIPTOR.fields
        if field.json_name in data
    }
    return {**ordered, **data}


def to_json(value: Any, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=sort_keys)


def pretty_json(value: Any) -> str:
    """For people: keys sorted, because a Struct's map comes back in no stable order."""
    return to_json(value, sort_keys=True)


def compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + ELLIPSIS


def summary(value: Any, width: int = 60) -> str:
    """`key=value, ...` on one line, keys sorted, strings unquoted, cut to `width`."""
    if value is None or value == {} or value == []:
        return EMPTY
    if isinstance(value, dict):
        parts = [
            f"{key}={item if isinstance(item, str) else compact_json(item)}"
            for key, item in sorted(value.items())
        ]
        text = ", ".join(parts)
    else:
        text = value if isinstance(value, str) else compact_json(value)
    return shorten(" ".join(text.split()), width)


def enum_label(name: str, prefix: str) -> str:
    """`INSTANCE_STATE_ACTIVE` -> `ACTIVE`."""
    return name.removeprefix(prefix)


def is_set(stamp: timestamp_pb2.Timestamp) -> bool:
    return bool(stamp.seconds or stamp.nanos)


def moment(stamp: timestamp_pb2.Timestamp, precise: bool = False) -> str:
    """UTC, to the second (or the millisecond for history, where order within a second matters)."""
    if not is_set(stamp):
        return EMPTY
    when = stamp.ToDatetime(tzinfo=datetime.UTC)
    if precise:
        return when.strftime("%Y-%m-%d %H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
    return when.strftime("%Y-%m-%d %H:%M:%SZ")


def age(stamp: timestamp_pb2.Timestamp, now: datetime.datetime | None = None) -> str:
    if not is_set(stamp):
        return EMPTY
    current = now or datetime.datetime.now(datetime.UTC)
    seconds = max(0, int((current - stamp.ToDatetime(tzinfo=datetime.UTC)).total_seconds()))
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
