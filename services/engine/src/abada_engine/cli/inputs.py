"""Reading variables and results from the command line into JSON values."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .errors import invalid_input


def _refuse_constant(name: str) -> Any:
    # Python's json accepts NaN and Infinity, which no JSON peer (and no protobuf Struct) can carry.
    raise ValueError(name)


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_refuse_constant)


def typed_value(text: str, key: str = "") -> Any:
    """`3` is a number, `true` a boolean, `{"a":1}` an object; anything that is not JSON stays a string,
    except what starts with `{` or `[`: that was meant as JSON, and a slip in it is refused, not sent as text."""
    try:
        return _loads(text)
    except ValueError as error:
        if text.lstrip().startswith(("{", "[")):
            kind = "object" if text.lstrip().startswith("{") else "array"
            raise invalid_input(
                f"--var {key}: starts like a JSON {kind} but is not valid JSON ({error}); "
                f"fix it, or quote it as a JSON string: --var '{key}=\"...\"'"
            ) from None
        return text


def json_object(text: str, option: str) -> dict[str, Any]:
    try:
        value = _loads(text)
    except ValueError as error:
        raise invalid_input(f"{option}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise invalid_input(f"{option}: must be a JSON object, not {type(value).__name__}")
    return value


def variables(assignments: Sequence[str], vars_json: str | None, option: str = "--var") -> dict[str, Any]:
    """`--vars-json` first, then every `--var KEY=VALUE` (or `option`) on top of it, in order."""
    values = json_object(vars_json, "--vars-json") if vars_json else {}
    for assignment in assignments:
        key, separator, raw = assignment.partition("=")
        if not separator or not key:
            raise invalid_input(f"{option} {assignment!r}: expected KEY=VALUE")
        values[key] = typed_value(raw, key)
    return values


def rfc3339(text: str, option: str) -> datetime:
    """An RFC 3339 time (`2026-12-04T09:00:00Z`, `2026-12-04T10:00:00+01:00`); one without a zone is
    refused rather than guessed."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise invalid_input(f"{option} {text!r}: not an RFC 3339 time (like 2026-12-04T09:00:00Z)") from None
    if moment.tzinfo is None:
        raise invalid_input(f"{option} {text!r}: give the zone too (Z for UTC, or +01:00)")
    return moment
