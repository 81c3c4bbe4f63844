"""Output primitives: aligned columns, JSON of protobuf messages, times, ages and short summaries."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from typing import Any

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


def plain_numbers(value: Any) -> Any:
    """Struct holds every number as a double; show `3`, as the user wrote it, rather than `3.0`."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: plain_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_numbers(item) for item in value]
    return value


def message_dict(message: Message) -> dict[str, Any]:
    return plain_numbers(json_format.MessageToDict(message, preserving_proto_field_name=False))


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
