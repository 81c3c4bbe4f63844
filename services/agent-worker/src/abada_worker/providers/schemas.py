"""Each provider's dialect of JSON Schema for function parameters, from an MCP tool's inputSchema.

OpenAI's strict mode (the model's arguments are guaranteed to match the schema) accepts only a
subset: every object closes with `additionalProperties: false` and lists every property in
`required`, a set of keywords is refused, and nesting and size are bounded. A schema inside
that subset is sent strict; any other goes as a plain (non-strict) function, untouched in meaning,
because making optional arguments required-but-nullable would hand the tool nulls it never
asked for. Anthropic takes JSON Schema as is but wants an object at the root.
"""

from __future__ import annotations

import copy
from typing import Any

# Keywords OpenAI's strict mode refuses (its structured-outputs guide, "Supported schemas").
STRICT_UNSUPPORTED_KEYWORDS = frozenset(
    {
        "allOf",
        "not",
        "oneOf",
        "if",
        "then",
        "else",
        "dependentRequired",
        "dependentSchemas",
        "patternProperties",
        "unevaluatedProperties",
        "unevaluatedItems",
        "propertyNames",
        "contains",
        "minContains",
        "maxContains",
        "prefixItems",
        "default",
    }
)
STRICT_MAX_DEPTH = 10
STRICT_MAX_PROPERTIES = 5000
STRICT_MAX_ENUM_VALUES = 1000
# Keywords that carry no meaning for the provider and that some servers refuse.
_META_KEYWORDS = ("$schema", "$id")


def openai_parameters(schema: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The parameters to declare and whether the function can be declared `strict`."""
    parameters = _object_root(schema)
    if not _strict_compatible(parameters, depth=0, counts=[0]):
        return parameters, False
    return _closed(parameters), True


def anthropic_input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return _object_root(schema)


def _object_root(schema: dict[str, Any]) -> dict[str, Any]:
    parameters = {key: value for key, value in copy.deepcopy(schema).items() if key not in _META_KEYWORDS}
    if parameters.get("type") != "object":
        # A tool without arguments may come with an empty schema; both providers want an object.
        parameters = {"properties": {}, **parameters}
        parameters["type"] = "object"
    parameters.setdefault("properties", {})
    return parameters


def _strict_compatible(schema: Any, *, depth: int, counts: list[int]) -> bool:
    if not isinstance(schema, dict):
        # Boolean schemas (`true`, `false`) have no place in strict mode.
        return False
    if depth > STRICT_MAX_DEPTH or STRICT_UNSUPPORTED_KEYWORDS & schema.keys():
        return False
    if len(schema.get("enum") or []) > STRICT_MAX_ENUM_VALUES:
        return False
    if schema.get("type") == "object" or "properties" in schema:
        properties = schema.get("properties") or {}
        counts[0] += len(properties)
        if counts[0] > STRICT_MAX_PROPERTIES:
            return False
        if set(schema.get("required") or []) != set(properties):
            return False
        if schema.get("additionalProperties", False) is not False:
            return False
        if not all(
            _strict_compatible(value, depth=depth + 1, counts=counts) for value in properties.values()
        ):
            return False
    for key in ("items",):
        if key in schema and not _strict_compatible(schema[key], depth=depth + 1, counts=counts):
            return False
    for key in ("anyOf",):
        if key in schema and not all(
            _strict_compatible(option, depth=depth + 1, counts=counts) for option in schema[key]
        ):
            return False
    for definitions in ("$defs", "definitions"):
        for value in (schema.get(definitions) or {}).values():
            if not _strict_compatible(value, depth=depth + 1, counts=counts):
                return False
    return True


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with `additionalProperties: false` on every object, as strict mode requires."""
    closed = dict(schema)
    if "properties" in closed:
        closed["properties"] = {name: _closed(value) for name, value in closed["properties"].items()}
    if closed.get("type") == "object" or "properties" in closed:
        closed["additionalProperties"] = False
    if isinstance(closed.get("items"), dict):
        closed["items"] = _closed(closed["items"])
    if "anyOf" in closed:
        closed["anyOf"] = [_closed(option) for option in closed["anyOf"]]
    for definitions in ("$defs", "definitions"):
        if definitions in closed:
            closed[definitions] = {name: _closed(value) for name, value in closed[definitions].items()}
    return closed
