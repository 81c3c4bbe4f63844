"""`{{...}}` templates in scripted arguments and answers, filled from the conversation.

Supported references:

- `{{input.NAME}}`: the value of the `<input name="NAME">` block (a string).
- `{{tool.FUNCTION}}`: the `response` object of the latest functionResponse named FUNCTION.
- `{{tool.FUNCTION.a.b.0}}`: a field inside it; numeric segments index lists.

A tool result usually arrives wrapped, e.g. `{"result": {...}}`, `{"output": "<json text>"}` or
an MCP CallToolResult `{"content": [{"type": "text", "text": "<json>"}], "structuredContent": {...}}`.
The field path is therefore tried, depth first, on the response itself and then on what it
wraps: the values under `result`, `output`, `structuredContent`, `structured_content`,
`content`, `data` and `text` (in that order), every item of a list, and any string that parses
as a JSON object or list. The first place where the whole path resolves wins.

A value that is exactly one template keeps its JSON type (like `${path}` in definitions);
a template inside longer text is replaced by the string itself, or by its JSON for other values.
A reference that cannot be resolved is an error: a script that does not fit the conversation
should fail loudly.
"""

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from scripted_gemini.conversation import Conversation

_TEMPLATE = re.compile(r"\{\{\s*([^{}\s]+)\s*\}\}")
_WRAPPER_KEYS = ("result", "output", "structuredContent", "structured_content", "content", "data", "text")
_MAX_UNWRAP_DEPTH = 8
_MISSING = object()


class TemplateError(ValueError):
    """A `{{...}}` reference does not resolve in this conversation."""


def render_value(value: Any, conversation: Conversation) -> Any:
    """Fills templates in a JSON value; strings that are one whole template keep the value's type."""
    if isinstance(value, str):
        whole = _TEMPLATE.fullmatch(value.strip())
        if whole:
            return resolve_reference(whole.group(1), conversation)
        return render_text(value, conversation)
    if isinstance(value, Mapping):
        return {key: render_value(item, conversation) for key, item in value.items()}
    if isinstance(value, list):
        return [render_value(item, conversation) for item in value]
    return value


def render_text(template: str, conversation: Conversation) -> str:
    def substitute(match: re.Match[str]) -> str:
        resolved = resolve_reference(match.group(1), conversation)
        return resolved if isinstance(resolved, str) else json.dumps(resolved, ensure_ascii=False)

    return _TEMPLATE.sub(substitute, template)


def resolve_reference(reference: str, conversation: Conversation) -> Any:
    namespace, _, rest = reference.partition(".")
    if namespace == "input":
        if not rest:
            raise TemplateError("{{input}} needs a name, e.g. {{input.customerId}}")
        if rest not in conversation.inputs:
            known = ", ".join(sorted(conversation.inputs)) or "none"
            raise TemplateError(f"{{{{{reference}}}}}: no <input name={rest!r}> block (inputs: {known})")
        return conversation.inputs[rest]
    if namespace == "tool":
        return _resolve_tool_reference(reference, rest, conversation)
    raise TemplateError(f"{{{{{reference}}}}}: unknown namespace {namespace!r}; use 'input' or 'tool'")


def _resolve_tool_reference(reference: str, rest: str, conversation: Conversation) -> Any:
    function_name, _, path = rest.partition(".")
    if not function_name:
        raise TemplateError("{{tool}} needs a function name, e.g. {{tool.crm__create_ticket.ticketId}}")
    function_response = conversation.latest_function_response(function_name)
    if function_response is None:
        raise TemplateError(f"{{{{{reference}}}}}: no functionResponse named {function_name!r} yet")
    if not path:
        return function_response.response
    segments = path.split(".")
    for candidate in _unwrapped(function_response.response, depth=0):
        found = _follow(candidate, segments)
        if found is not _MISSING:
            return found
    raise TemplateError(
        f"{{{{{reference}}}}}: field {path!r} not found in the {function_name} response "
        f"{json.dumps(function_response.response, ensure_ascii=False)[:300]}"
    )


def _unwrapped(value: Any, depth: int) -> Iterator[Any]:
    yield value
    if depth >= _MAX_UNWRAP_DEPTH:
        return
    if isinstance(value, Mapping):
        for key in _WRAPPER_KEYS:
            if key in value:
                yield from _unwrapped(value[key], depth + 1)
    elif isinstance(value, list):
        for item in value:
            yield from _unwrapped(item, depth + 1)
    elif isinstance(value, str):
        parsed = _parse_json_container(value)
        if parsed is not None:
            yield from _unwrapped(parsed, depth + 1)


def _parse_json_container(text: str) -> dict[str, Any] | list[Any] | None:
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        parsed = json.loads(stripped)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict | list) else None


def _follow(value: Any, segments: list[str]) -> Any:
    for segment in segments:
        if isinstance(value, Mapping) and segment in value:
            value = value[segment]
        elif isinstance(value, list) and segment.isdigit() and int(segment) < len(value):
            value = value[int(segment)]
        else:
            return _MISSING
    return value
