"""Output schemas (JSON Schema 2020-12): refused at deploy when unsafe, validated without side effects.

An output schema is written by whoever deploys, and the value it checks comes from a worker or a
model. Two things would let either of them hurt the engine, so neither is possible here:

- references: jsonschema's default registry downloads any `$ref` it cannot resolve locally (a
  blocking `urlopen` with no timeout, `file://` included). Validators here get an empty registry,
  which fetches nothing, and deploy refuses every `$ref`/`$dynamicRef` that is not a `#` fragment.
- patterns: Python's `re` backtracks, so `^([a-z]+ ?)+$` against a few dozen characters takes
  seconds. `pattern`, `patternProperties` and the `additionalProperties` that depend on them run on
  RE2 (linear time) instead; deploy refuses a pattern RE2 cannot compile.
- cost: jsonschema checks `uniqueItems` by comparing every pair (4,000 objects took 17 s), and a
  schema can multiply work (`anyOf` over references that branch again). Uniqueness here is one pass
  over the items' canonical JSON, and every keyword evaluated is charged to the `WorkBudget` in force
  (`work_budget`): a check that would run past its budget stops and fails closed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import jsonschema
import jsonschema.validators
import re2
from jsonschema.exceptions import ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable

from .work_budget import WorkBudgetSpent, charge

# A schema is configuration, not data: this is far more than any real one needs.
MAX_SCHEMA_BYTES = 65_536

# Resolves only what is inside the schema itself; `retrieve` is absent, so nothing is ever fetched.
_NOTHING_TO_FETCH: Registry[Any] = Registry()

_REFERENCE_KEYWORDS = ("$ref", "$dynamicRef")
_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.max_mem = 8 << 20  # a hostile pattern cannot make RE2 build an enormous automaton
_RE2_OPTIONS.log_errors = False  # a refused pattern is reported to the deployer, not to stderr


@lru_cache(maxsize=1024)
def _regex(pattern: str) -> Any:
    return re2.compile(pattern, options=_RE2_OPTIONS)


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not _regex(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: dict[str, Any], instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        regex = _regex(pattern)
        for name, value in instance.items():
            if regex.search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    declared = schema.get("properties", {})
    patterns = [_regex(p) for p in schema.get("patternProperties", {})]
    extras = [name for name in instance if name not in declared and not any(r.search(name) for r in patterns)]
    if validator.is_type(additional, "object"):
        for name in extras:
            yield from validator.descend(instance[name], additional, path=name)
    elif not additional and extras:
        listed = ", ".join(repr(name) for name in sorted(extras))
        were = "was" if len(extras) == 1 else "were"
        yield ValidationError(f"Additional properties are not allowed ({listed} {were} unexpected)")


def _unique_items(
    validator: Any, unique: bool, instance: Any, schema: dict[str, Any]
) -> Iterator[ValidationError]:
    """Uniqueness in one pass: equal items (JSON Schema's equality) have the same canonical JSON."""
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[str] = set()
    for item in instance:
        charge()
        canonical = json.dumps(_canonical(item), sort_keys=True, separators=(",", ":"))
        if canonical in seen:
            yield ValidationError(f"{instance!r:.200} has non-unique elements")
            return
        seen.add(canonical)


def _canonical(value: Any) -> Any:
    """The value with JSON Schema's equality made textual: 1 and 1.0 are one number, true is not 1."""
    if isinstance(value, bool) or value is None or isinstance(value, str | int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {str(key): _canonical(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    return value


def _charged(keyword: Any) -> Any:
    """The keyword's check, charged one step of the budget in force each time it is evaluated."""

    def charged(validator: Any, value: Any, instance: Any, schema: dict[str, Any]) -> Any:
        charge()
        return keyword(validator, value, instance, schema)

    return charged


_KEYWORDS: dict[str, Any] = {
    **jsonschema.Draft202012Validator.VALIDATORS,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}
_OutputValidator = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    {name: _charged(keyword) for name, keyword in _KEYWORDS.items()},
)


def schema_problems(schema: dict[str, Any]) -> list[str]:
    """Why an output schema cannot be deployed; empty when it can."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        return [f"is larger than {MAX_SCHEMA_BYTES} bytes as JSON"]
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        at = "/".join(str(p) for p in error.path)
        return [f"not a valid JSON Schema 2020-12{f' at {at}' if at else ''}: {error.message}"]
    problems: list[str] = []
    uses_pattern_properties = False
    uses_unevaluated_properties = False
    for where, subschema in _subschemas(schema, ()):
        for keyword in _REFERENCE_KEYWORDS:
            target = subschema.get(keyword)
            if isinstance(target, str) and not target.startswith("#"):
                problems.append(
                    f"{_pointer(where, keyword)}: {target!r} points outside the schema; only local "
                    "references ('#...') are allowed, nothing is fetched"
                )
        pattern = subschema.get("pattern")
        if isinstance(pattern, str):
            problems.extend(_pattern_problem(_pointer(where, "pattern"), pattern))
        pattern_properties = subschema.get("patternProperties")
        if isinstance(pattern_properties, dict):
            uses_pattern_properties = True
            for key in pattern_properties:
                problems.extend(_pattern_problem(_pointer(where, "patternProperties"), key))
        uses_unevaluated_properties |= "unevaluatedProperties" in subschema
    if uses_pattern_properties and uses_unevaluated_properties:
        # jsonschema matches patternProperties with Python's backtracking `re` when it works out
        # unevaluatedProperties; refusing the pair keeps every pattern on RE2.
        problems.append("patternProperties cannot be combined with unevaluatedProperties")
    return problems


def _pattern_problem(where: str, pattern: str) -> list[str]:
    try:
        _regex(pattern)
    except re2.error as error:
        detail = error.args[0] if error.args else ""
        why = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        return [f"{where}: {pattern!r} is not a pattern this engine runs in linear time (RE2): {why}"]
    return []


def _pointer(where: tuple[str, ...], keyword: str) -> str:
    return "/".join((*where, keyword))


def _subschemas(value: Any, where: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every mapping in the schema with where it is; over-inclusive (a `const` object too) on purpose."""
    if isinstance(value, dict):
        yield where, value
        for key, item in value.items():
            yield from _subschemas(item, (*where, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _subschemas(item, (*where, str(index)))


@lru_cache(maxsize=512)
def _validator(schema_json: str) -> Any:
    return _OutputValidator(json.loads(schema_json), registry=_NOTHING_TO_FETCH)


def output_errors(schema: dict[str, Any], value: Any) -> list[ValidationError]:
    """The ways `value` breaks `schema`, first by path; a reference nothing resolves is one of them,
    and so is a check that ran out of its budget (`work_budget`): both fail closed."""
    validator = _validator(json.dumps(schema, sort_keys=True))
    try:
        return sorted(validator.iter_errors(value), key=lambda e: [str(p) for p in e.path])
    except Unresolvable as error:
        # A definition deployed before references were refused can still name one; it fails closed.
        return [ValidationError(f"the output_schema has a reference that is not resolved: {error}")]
    except WorkBudgetSpent as spent:
        return [ValidationError(f"checking the output against output_schema was stopped: {spent.why}")]


def input_problem(schema: dict[str, Any], variables: dict[str, Any]) -> tuple[str, str] | None:
    """The first way start `variables` break a process's `inputs:` schema: (the variable, why).

    A missing required variable is named itself (`customerId`), not the object that lacks it."""
    errors = output_errors(schema, variables)
    if not errors:
        return None
    error = errors[0]
    path = [str(part) for part in error.path]
    required = error.validator_value
    if error.validator == "required" and isinstance(error.instance, dict) and isinstance(required, list):
        missing = [name for name in required if name not in error.instance]
        if missing:
            return ".".join([*path, missing[0]]), "is required by the process's inputs and was not given"
    if not path:
        return "", error.message
    return ".".join(path), error.message
