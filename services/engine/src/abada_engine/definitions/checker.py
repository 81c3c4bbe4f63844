"""Checking a bundle's values field by field, collecting every problem with its file, line and path.

The section checks in `parser.py` ask a `Checker` for each value (`string`, `integer`, `duration`,
`amount`, `mapping` with its allowed keys); a wrong one is reported and a safe value returned, so one
deploy attempt shows the author everything that is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from abada_engine.errors import FieldProblem

from .durations import iso_duration_seconds
from .yaml_source import Located, path_text


@dataclass
class Checker:
    source_name: str
    located: Located
    problems: list[FieldProblem] = field(default_factory=list)

    def line_of(self, path: tuple[str | int, ...]) -> int:
        while path and path not in self.located.lines:
            path = path[:-1]
        return self.located.lines.get(path, 1)

    def report(self, path: tuple[str | int, ...], why: str) -> None:
        self.problems.append(FieldProblem(path_text(path), why, self.source_name, self.line_of(path)))

    def mapping(self, value: Any, path: tuple[str | int, ...], allowed: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.report(path, f"must be a mapping, not {kind(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.report((*path, key), f"unknown field (expected one of: {', '.join(sorted(allowed))})")
        return value

    def entries(
        self, raw: Any, section: str, expected: str, allowed: set[str]
    ) -> Iterator[tuple[tuple[str | int, ...], dict[str, Any]]]:
        """Each mapping of the top-level list `section`, with its path; a `section` that is no list is
        reported as not being `expected`."""
        if not isinstance(raw, list):
            self.report((section,), f"must be {expected}, not {kind(raw)}")
            return
        for index, item in enumerate(raw):
            path = (section, index)
            yield path, self.mapping(item, path, allowed)

    def string(
        self,
        data: dict[str, Any],
        key: str,
        path: tuple[str | int, ...],
        *,
        required: bool = True,
        pattern: re.Pattern[str] | None = None,
        what: str = "",
    ) -> str | None:
        if key not in data or data[key] is None:
            if required:
                self.report((*path, key), "is required")
            return None
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            self.report((*path, key), f"must be a non-empty string, not {kind(value)}")
            return None
        if pattern and not pattern.match(value):
            self.report((*path, key), f"{value!r} is not a valid {what or key}")
            return None
        return value

    def integer(
        self, data: dict[str, Any], key: str, path: tuple[str | int, ...], default: int, minimum: int = 0
    ) -> int:
        value = data.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.report((*path, key), f"must be an integer >= {minimum}, not {value!r}")
            return default
        return value

    def flag(self, data: dict[str, Any], key: str, path: tuple[str | int, ...]) -> bool:
        """A yes/no setting, false when absent."""
        value = data.get(key, False)
        if not isinstance(value, bool):
            self.report((*path, key), f"must be true or false, not {kind(value)}")
            return False
        return value

    def optional_integer(
        self, data: dict[str, Any], key: str, path: tuple[str | int, ...], minimum: int = 1
    ) -> int | None:
        if data.get(key) is None:
            return None
        return self.integer(data, key, path, minimum, minimum)

    def duration(self, data: dict[str, Any], key: str, path: tuple[str | int, ...]) -> float | None:
        """A positive ISO-8601 duration in seconds (`PT30M`, `P2D`), or None when absent or wrong."""
        text = self.string(data, key, path, required=False)
        if text is None:
            return None
        seconds = iso_duration_seconds(text)
        if seconds is None or seconds <= 0:
            self.report(
                (*path, key),
                f"{text!r} is not a positive ISO-8601 duration (for example PT30M, P2D, PT1H30M)",
            )
            return None
        return seconds

    def amount(
        self, data: dict[str, Any], key: str, path: tuple[str | int, ...], *, positive: bool = False
    ) -> float | None:
        """A dollar figure: a number >= 0 (> 0 when `positive`), or None when absent."""
        value = data.get(key)
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or value < 0
            or (positive and value == 0)
        ):
            self.report(
                (*path, key), f"must be a number {'> 0' if positive else '>= 0'} (US dollars), not {value!r}"
            )
            return None
        return float(value)


def kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "empty"}.get(
        type(value), type(value).__name__
    )
