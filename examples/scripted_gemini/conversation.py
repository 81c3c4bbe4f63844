"""Reading a Gemini `generateContent` request body into what the script player needs.

Everything is derived from the request alone, never from server memory: a worker that crashed
and whose successor rebuilds the conversation from its journal gets the same answer.
"""

import hashlib
import html
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class RequestError(ValueError):
    """The request body is not a usable generateContent request."""


_INPUT_BLOCK = re.compile(r'<input\s+name="([^"]*)"\s*>(.*?)</input>', re.DOTALL)


@dataclass(frozen=True)
class FunctionResponse:
    name: str
    response: Any


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    # Number of model turns already in `contents`, i.e. the index of the turn to play now.
    turn_index: int
    system_text: str
    first_user_text: str
    # `<input name="...">` values, unescaped; a name in the first user content wins over the same
    # name in the system instruction.
    inputs: Mapping[str, str]
    function_responses: tuple[FunctionResponse, ...]
    declared_functions: frozenset[str]
    # Canonical JSON of what the model would read, used for deterministic prompt token counts.
    prompt_text: str

    @property
    def selection_text(self) -> str:
        return f"{self.system_text}\n{self.first_user_text}"

    def latest_function_response(self, name: str) -> FunctionResponse | None:
        for function_response in reversed(self.function_responses):
            if function_response.name == name:
                return function_response
        return None


def read_conversation(body: Any) -> Conversation:
    if not isinstance(body, Mapping):
        raise RequestError("request body must be a JSON object")
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        raise RequestError("'contents' must be a non-empty list")
    if not all(isinstance(content, Mapping) for content in contents):
        raise RequestError("every entry of 'contents' must be an object")

    system_text = _text_of(_camel_or_snake(body, "systemInstruction", "system_instruction"))
    first_user = next((content for content in contents if content.get("role", "user") != "model"), None)
    if first_user is None:
        raise RequestError("'contents' holds no user content")
    first_user_text = _text_of(first_user)

    inputs = {**input_blocks(system_text), **input_blocks(first_user_text)}
    turn_index = sum(1 for content in contents if content.get("role") == "model")
    tools = body.get("tools") or []
    prompt_material = {
        "systemInstruction": _camel_or_snake(body, "systemInstruction", "system_instruction"),
        "contents": contents,
        "tools": tools,
    }
    return Conversation(
        conversation_id=conversation_id_of(system_text, first_user_text),
        turn_index=turn_index,
        system_text=system_text,
        first_user_text=first_user_text,
        inputs=inputs,
        function_responses=tuple(_function_responses(contents)),
        declared_functions=frozenset(_declared_function_names(tools)),
        prompt_text=json.dumps(prompt_material, sort_keys=True, separators=(",", ":"), ensure_ascii=False),
    )


def conversation_id_of(system_text: str, first_user_text: str) -> str:
    digest = hashlib.sha256(f"{system_text}\x1f{first_user_text}".encode()).hexdigest()
    return digest[:16]


def _camel_or_snake(mapping: Mapping[str, Any], camel: str, snake: str) -> Any:
    # The SDK sends camelCase for most fields but snake_case for a few (parameters_json_schema).
    return mapping.get(camel, mapping.get(snake))


def _text_of(content: Any) -> str:
    """The text parts of a Content (or a bare string, which the REST API also accepts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, Mapping):
        raise RequestError("a content must be an object with 'parts'")
    parts = content.get("parts") or []
    if not isinstance(parts, list):
        raise RequestError("'parts' must be a list")
    return "\n".join(
        part["text"] for part in parts if isinstance(part, Mapping) and isinstance(part.get("text"), str)
    )


def input_blocks(text: str) -> dict[str, str]:
    """The `<input name="...">` values in a text, unescaped (the worker escapes them)."""
    return {html.unescape(name): html.unescape(value).strip() for name, value in _INPUT_BLOCK.findall(text)}


def _function_responses(contents: list[Mapping[str, Any]]) -> list[FunctionResponse]:
    found: list[FunctionResponse] = []
    for content in contents:
        for part in content.get("parts") or []:
            if not isinstance(part, Mapping):
                continue
            payload = _camel_or_snake(part, "functionResponse", "function_response")
            if isinstance(payload, Mapping) and isinstance(payload.get("name"), str):
                found.append(FunctionResponse(name=payload["name"], response=payload.get("response")))
    return found


def _declared_function_names(tools: Any) -> list[str]:
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    names: list[str] = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            raise RequestError("every entry of 'tools' must be an object")
        declarations = _camel_or_snake(tool, "functionDeclarations", "function_declarations") or []
        names.extend(
            declaration["name"]
            for declaration in declarations
            if isinstance(declaration, Mapping) and isinstance(declaration.get("name"), str)
        )
    return names
