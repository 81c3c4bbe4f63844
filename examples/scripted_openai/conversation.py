"""Reading a Chat Completions request into the shared `Conversation`, refusing what OpenAI refuses.

The checks are the ones the real API makes and a client could get wrong: every assistant
`tool_calls` entry answered by a `tool` message with its `tool_call_id` before the next turn, no
`tool` message without its call, function names within OpenAI's pattern, and for `strict`
functions the strict-mode schema rules. A request that breaks one gets the API's 400.
"""

import json
import re
from collections.abc import Mapping
from typing import Any

from scripted_gemini.conversation import (
    Conversation,
    FunctionResponse,
    RequestError,
    conversation_id_of,
    input_blocks,
)

_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_STRICT_REFUSED = (
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
    "propertyNames",
    "default",
)


class OpenAIRequestError(RequestError):
    """A request the real API would refuse; `param` names the offending field as OpenAI does."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def read_chat_request(body: Any) -> tuple[str, Conversation]:
    """The model asked for and the conversation so far."""
    if not isinstance(body, Mapping):
        raise OpenAIRequestError("We could not parse the JSON body of your request.")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIRequestError("you must provide a model parameter", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIRequestError("[] is too short - 'messages'", "messages")
    if body.get("stream"):
        raise OpenAIRequestError("the scripted endpoint does not stream", "stream")
    declared = _declared_functions(body.get("tools"))

    system_parts: list[str] = []
    first_user: str | None = None
    turn_index = 0
    names_by_call: dict[str, str] = {}
    awaiting: list[str] = []
    responses: list[FunctionResponse] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise OpenAIRequestError(f"Invalid type for 'messages[{index}]'", f"messages[{index}]")
        role = message.get("role")
        if role != "tool" and awaiting:
            raise OpenAIRequestError(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to "
                f"each 'tool_call_id'. The following tool_call_ids did not have response messages: "
                f"{', '.join(awaiting)}",
                f"messages.[{index}].role",
            )
        if role in ("system", "developer"):
            system_parts.append(_text_of(message.get("content"), index))
        elif role == "user":
            text = _text_of(message.get("content"), index)
            first_user = text if first_user is None else first_user
        elif role == "assistant":
            turn_index += 1
            for call in message.get("tool_calls") or []:
                call_id, name = _call_of(call, index)
                names_by_call[call_id] = name
                awaiting.append(call_id)
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in awaiting:
                raise OpenAIRequestError(
                    "Invalid parameter: messages with role 'tool' must be a response to a preceeding "
                    "message with 'tool_calls'.",
                    f"messages.[{index}].role",
                )
            awaiting.remove(call_id)
            responses.append(
                FunctionResponse(names_by_call[call_id], _text_of(message.get("content"), index))
            )
        else:
            raise OpenAIRequestError(
                f"Invalid value: '{role}'. Supported values are: 'system', 'developer', "
                "'user', 'assistant', and 'tool'.",
                f"messages[{index}].role",
            )
    if awaiting:
        raise OpenAIRequestError(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
            f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(awaiting)}",
            "messages",
        )
    if first_user is None:
        raise OpenAIRequestError("the conversation holds no user message", "messages")
    system_text = "\n".join(system_parts)
    return model, Conversation(
        conversation_id=conversation_id_of(system_text, first_user),
        turn_index=turn_index,
        system_text=system_text,
        first_user_text=first_user,
        inputs={**input_blocks(system_text), **input_blocks(first_user)},
        function_responses=tuple(responses),
        declared_functions=frozenset(declared),
        prompt_text=json.dumps(
            {"messages": messages, "tools": body.get("tools") or []},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ),
    )


def _text_of(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "")
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    raise OpenAIRequestError(f"Invalid type for 'messages[{index}].content'", f"messages[{index}].content")


def _call_of(call: Any, index: int) -> tuple[str, str]:
    function = call.get("function") if isinstance(call, Mapping) else None
    call_id = call.get("id") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(call_id, str) or not call_id:
        raise OpenAIRequestError(f"Missing required parameter: 'messages[{index}].tool_calls'.")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        raise OpenAIRequestError(
            f"Invalid type for 'messages[{index}].tool_calls.function.arguments': expected a string"
        )
    return call_id, str(function.get("name", ""))


def _declared_functions(tools: Any) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise OpenAIRequestError("Invalid type for 'tools': expected an array", "tools")
    names: list[str] = []
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(function, Mapping)
        ):
            raise OpenAIRequestError(
                f"Missing required parameter: 'tools[{index}].function'.", f"tools[{index}]"
            )
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise OpenAIRequestError(
                f"Invalid 'tools[{index}].function.name': string does not match pattern. Expected a string "
                "that matches the pattern '^[a-zA-Z0-9_-]+$'.",
                f"tools[{index}].function.name",
            )
        if function.get("strict"):
            problem = strict_schema_problem(function.get("parameters") or {}, ())
            if problem:
                raise OpenAIRequestError(
                    f"Invalid schema for function '{name}': {problem}", f"tools[{index}].function.parameters"
                )
        names.append(name)
    return names


def strict_schema_problem(schema: Any, context: tuple[str, ...]) -> str | None:
    """What strict mode refuses in a schema, in OpenAI's words; None when it is acceptable."""
    where = f"In context={context!r}"
    if not isinstance(schema, Mapping):
        return f"{where}, schema must be a JSON Schema of 'type: \"object\"', got '{schema!r}'."
    for keyword in _STRICT_REFUSED:
        if keyword in schema:
            return f"{where}, '{keyword}' is not permitted."
    if schema.get("type") == "object" or "properties" in schema:
        if schema.get("additionalProperties") is not False:
            return f"{where}, 'additionalProperties' is required to be supplied and to be false."
        properties = schema.get("properties") or {}
        missing = [name for name in properties if name not in (schema.get("required") or [])]
        if missing:
            return (
                f"{where}, 'required' is required to be supplied and to be an array including every key in "
                f"properties. Missing '{missing[0]}'."
            )
        for name, value in properties.items():
            problem = strict_schema_problem(value, (*context, "properties", name))
            if problem:
                return problem
    if isinstance(schema.get("items"), Mapping):
        return strict_schema_problem(schema["items"], (*context, "items"))
    for position, option in enumerate(schema.get("anyOf") or []):
        problem = strict_schema_problem(option, (*context, "anyOf", str(position)))
        if problem:
            return problem
    return None
