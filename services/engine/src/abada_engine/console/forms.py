"""Forms generated from a JSON Schema (a tool's arguments, a user task's output), and their answers
read back and checked against the same schema before anything is sent to the engine."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import re2
from jsonschema.exceptions import SchemaError

from abada_engine.definitions.schemas import output_errors
from abada_engine.definitions.work_budget import WorkBudget, spending

PREFIX = "field."
# What checking one form may cost: far more than a real tool's arguments need.
CHECK_STEPS = 200_000
CHECK_SECONDS = 0.5


@dataclass
class Field:
    name: str
    # text, textarea, integer, number, boolean, select or json (anything else, edited as JSON).
    kind: str
    value: str
    required: bool
    description: str = ""
    options: list[str] = field(default_factory=list)
    error: str = ""
    # The original value as the form shows it, to mark what a person changed.
    original: str = ""

    @property
    def input_name(self) -> str:
        return PREFIX + self.name

    @property
    def input_id(self) -> str:
        return "f-" + "".join(c if c.isalnum() else "-" for c in self.name)


def inferred_schema(values: dict[str, Any]) -> dict[str, Any]:
    """A schema that keeps each proposed argument's JSON type: what a form can check when the tool's
    own input schema is not at hand."""
    properties: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            properties[name] = {"type": "boolean"}
        elif isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            properties[name] = {"type": "integer"}
        elif isinstance(value, float):
            properties[name] = {"type": "number"}
        elif isinstance(value, str):
            properties[name] = {"type": "string"}
        elif isinstance(value, list):
            properties[name] = {"type": "array"}
        elif isinstance(value, dict):
            properties[name] = {"type": "object"}
        else:
            properties[name] = {}
    return {"type": "object", "properties": properties, "required": sorted(values)}


def _kind(schema: dict[str, Any]) -> str:
    if "enum" in schema and all(isinstance(o, str) for o in schema["enum"]):
        return "select"
    kind = schema.get("type")
    if kind == "string":
        return (
            "textarea" if schema.get("maxLength", 0) > 200 or schema.get("format") == "textarea" else "text"
        )
    if kind in ("integer", "number", "boolean"):
        return str(kind)
    return "json"


def _shown(kind: str, value: Any) -> str:
    if value is None:
        return ""
    if kind in ("text", "textarea", "select"):
        return value if isinstance(value, str) else json.dumps(value)
    if kind == "boolean":
        return "true" if value is True else ""
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        return str(int(value))
    if kind in ("integer", "number"):
        return str(value)
    return json.dumps(value, indent=2, ensure_ascii=False)


def fields_for(schema: dict[str, Any], values: dict[str, Any]) -> list[Field]:
    """One field per property of the schema (then any value it does not name), filled with `values`."""
    declared: dict[str, Any] = dict(schema.get("properties") or {})
    for extra in values:
        declared.setdefault(extra, {})
    # A stable order (a schema read back from a protobuf Struct has lost its own): the required
    # properties as the schema lists them, then the others by name.
    listed = [str(n) for n in schema.get("required") or [] if n in declared]
    properties = {name: declared[name] for name in listed + sorted(set(declared) - set(listed))}
    required = set(listed)
    result = []
    for name, sub in properties.items():
        sub = sub if isinstance(sub, dict) else {}
        kind = _kind(sub)
        shown = _shown(kind, values.get(name, sub.get("default")))
        result.append(
            Field(
                name,
                kind,
                shown,
                name in required,
                str(sub.get("description", "")),
                [str(o) for o in sub.get("enum", [])],
                original=_shown(kind, values.get(name)),
            )
        )
    return result


def read_answers(fields: list[Field], form: dict[str, str]) -> tuple[dict[str, Any], bool]:
    """The values the form sent, typed as the fields say; sets each field's value (and error when it
    cannot be read). Answers whether every field could be read."""
    answers: dict[str, Any] = {}
    readable = True
    for f in fields:
        raw = form.get(f.input_name, "")
        f.value = "true" if f.kind == "boolean" and raw else raw
        f.error = ""
        if f.kind == "boolean":
            answers[f.name] = bool(raw)
            continue
        if raw.strip() == "" and f.kind != "text" and f.kind != "textarea":
            continue  # left empty: absent (the schema says whether that may be)
        if raw == "" and not f.required:
            continue
        try:
            answers[f.name] = _typed(f.kind, raw)
        except ValueError as error:
            f.error = str(error)
            readable = False
    return answers, readable


def _typed(kind: str, raw: str) -> Any:
    if kind == "integer":
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError("a whole number") from None
    if kind == "number":
        try:
            number = float(raw.strip())
        except ValueError:
            raise ValueError("a number") from None
        if not math.isfinite(number):
            raise ValueError("a finite number")
        return number
    if kind == "json":
        try:
            return json.loads(raw)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error.msg} (line {error.lineno})") from None
    return raw


def check(schema: dict[str, Any], answers: dict[str, Any], fields: list[Field]) -> list[str]:
    """Checks `answers` against `schema`; puts each problem on its field and answers those no field
    holds (for the top of the form).

    The schema came from a tool server (or a deployer): it is checked the way the engine checks
    output schemas (patterns on RE2, no reference fetched) and within a work budget, so a hostile one
    cannot stall the engine this console runs in. Run it off the event loop."""
    by_name = {f.name: f for f in fields}
    general: list[str] = []
    with spending(WorkBudget(CHECK_STEPS, CHECK_SECONDS)):
        try:
            errors = output_errors(schema, answers)
        except (SchemaError, ValueError, TypeError, re2.error) as broken:
            return [
                f"the form's schema cannot be used ({type(broken).__name__}); ask whoever deployed the process"
            ]
    for problem in errors:
        path = list(problem.path)
        target = by_name.get(str(path[0])) if path else None
        message = problem.message
        if target is None and problem.validator == "required" and isinstance(problem.instance, dict):
            named = problem.validator_value if isinstance(problem.validator_value, list) else []
            missing = [n for n in named if n not in problem.instance]
            target = by_name.get(str(missing[0])) if missing else None
            message = "required"
        if target is not None:
            target.error = target.error or message
        else:
            general.append(message)
    return general
