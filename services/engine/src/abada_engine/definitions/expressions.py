"""`${path}` references into process variables, and CEL conditions over them."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import celpy
import celpy.celtypes

_REFERENCE = re.compile(r"\$\{([^}]*)\}")
_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\])*$")
_SEGMENT = re.compile(r"\.?([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


class ExpressionError(Exception):
    """A reference or condition could not be evaluated against the variables."""


def reference_syntax_errors(text: str) -> list[str]:
    """The malformed `${...}` references in a template, for deploy-time validation."""
    return [
        f"bad reference ${{{path}}}" for path in _REFERENCE.findall(text) if not _PATH.match(path.strip())
    ]


def lookup(variables: Mapping[str, Any], path: str) -> Any:
    value: Any = variables
    for name, index in _SEGMENT.findall(path.strip()):
        if name:
            if not isinstance(value, Mapping) or name not in value:
                raise ExpressionError(f"variable ${{{path}}} is not set")
            value = value[name]
        else:
            if not isinstance(value, list) or int(index) >= len(value):
                raise ExpressionError(f"variable ${{{path}}} is out of range")
            value = value[int(index)]
    return value


def render(template: Any, variables: Mapping[str, Any]) -> Any:
    """Resolve references in a template value.

    A string that is exactly one reference keeps the referenced JSON type; a
    reference inside other text is interpolated (non-strings as compact JSON).
    Lists and mappings are rendered element by element.
    """
    if isinstance(template, str):
        whole = _REFERENCE.fullmatch(template.strip())
        if whole:
            return lookup(variables, whole.group(1))

        def interpolate(match: re.Match[str]) -> str:
            value = lookup(variables, match.group(1))
            return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))

        return _REFERENCE.sub(interpolate, template)
    if isinstance(template, list):
        return [render(item, variables) for item in template]
    if isinstance(template, Mapping):
        return {key: render(value, variables) for key, value in template.items()}
    return template


_CEL_ENV = celpy.Environment()


def cel_syntax_error(expression: str) -> str | None:
    try:
        _CEL_ENV.compile(expression)
    except celpy.CELParseError as error:
        return f"invalid CEL: {' '.join(str(error).split())}"
    return None


@lru_cache(maxsize=1024)
def _program(expression: str) -> Any:
    return _CEL_ENV.program(_CEL_ENV.compile(expression))


def evaluate_condition(expression: str, variables: Mapping[str, Any]) -> bool:
    activation = {name: celpy.json_to_cel(value) for name, value in variables.items()}
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELEvalError as error:
        cause = error.args[1].__name__ if len(error.args) > 1 and isinstance(error.args[1], type) else ""
        detail = error.args[2] if len(error.args) > 2 else ""
        raise ExpressionError(f"condition {expression!r} failed: {cause} {detail}".strip()) from None
    if not isinstance(result, (bool, celpy.celtypes.BoolType)):
        raise ExpressionError(f"condition {expression!r} gave {type(result).__name__}, not a bool")
    return bool(result)
