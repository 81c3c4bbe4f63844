"""Reading a Messages request into the shared `Conversation`, refusing what Anthropic refuses.

The checks are the ones the real API makes and a client could get wrong: `max_tokens` present,
roles alternating from a user message, every `tool_use` block answered by a `tool_result` with its
id in the very next user message (and no `tool_result` without its `tool_use`), tool names within
the pattern and each `input_schema` an object schema. A request that breaks one gets the API's 400.
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

_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


class AnthropicRequestError(RequestError):
    """A request the real API would refuse (`invalid_request_error`)."""


def read_messages_request(body: Any) -> tuple[str, Conversation]:
    if not isinstance(body, Mapping):
        raise AnthropicRequestError("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise AnthropicRequestError("model: Field required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise AnthropicRequestError("max_tokens: Field required")
    if body.get("stream"):
        raise AnthropicRequestError("stream: the scripted endpoint does not stream")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError("messages: at least one message is required")
    declared = _declared_tools(body.get("tools"))
    system_text = _system_text(body.get("system"))

    first_user: str | None = None
    turn_index = 0
    names_by_id: dict[str, str] = {}
    pending: list[str] = []
    responses: list[FunctionResponse] = []
    previous_role = None
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise AnthropicRequestError(f"messages.{index}.role: Input should be 'user' or 'assistant'")
        role = message["role"]
        if index == 0 and role != "user":
            raise AnthropicRequestError('messages: first message must use the "user" role')
        if role == previous_role:
            raise AnthropicRequestError(
                f'messages.{index}: roles must alternate between "user" and "assistant"'
            )
        previous_role = role
        blocks = _blocks(message.get("content"), index)
        if role == "assistant":
            turn_index += 1
            pending = []
            for block in blocks:
                if block.get("type") == "tool_use":
                    names_by_id[str(block.get("id"))] = str(block.get("name"))
                    pending.append(str(block.get("id")))
            continue
        answered = [block for block in blocks if block.get("type") == "tool_result"]
        for position, block in enumerate(answered):
            use_id = str(block.get("tool_use_id"))
            if use_id not in pending:
                raise AnthropicRequestError(
                    f"messages.{index}.content.{position}: unexpected `tool_use_id` found in `tool_result` "
                    f"blocks: {use_id}. Each `tool_result` block must have a corresponding `tool_use` block "
                    "in the previous message."
                )
            responses.append(FunctionResponse(names_by_id[use_id], _result_text(block.get("content"))))
        missing = [
            use_id for use_id in pending if use_id not in {str(b.get("tool_use_id")) for b in answered}
        ]
        if missing:
            raise AnthropicRequestError(
                f"messages.{index}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                f"{', '.join(missing)}. Each `tool_use` block must have a corresponding `tool_result` block "
                "in the next message."
            )
        pending = []
        if first_user is None:
            first_user = "".join(
                str(block.get("text", "")) for block in blocks if block.get("type") == "text"
            )
    if pending:
        raise AnthropicRequestError(
            "messages: the conversation ends with `tool_use` blocks that have no `tool_result`: "
            + ", ".join(pending)
        )
    assert first_user is not None  # the first message is a user message
    return model, Conversation(
        conversation_id=conversation_id_of(system_text, first_user),
        turn_index=turn_index,
        system_text=system_text,
        first_user_text=first_user,
        inputs={**input_blocks(system_text), **input_blocks(first_user)},
        function_responses=tuple(responses),
        declared_functions=frozenset(declared),
        prompt_text=json.dumps(
            {"system": body.get("system"), "messages": messages, "tools": body.get("tools") or []},
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=False,
        ),
    )


def _blocks(content: Any, index: int) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, Mapping) for block in content):
        raise AnthropicRequestError(f"messages.{index}.content: Input should be a valid list")
    if not content:
        raise AnthropicRequestError(f"messages.{index}: all messages must have non-empty content")
    return list(content)


def _system_text(system: Any) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "".join(str(block.get("text", "")) for block in system if isinstance(block, Mapping))
    raise AnthropicRequestError("system: Input should be a valid string or list of text blocks")


def _result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(block.get("text", "")) for block in content if isinstance(block, Mapping))
    return ""


def _declared_tools(tools: Any) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise AnthropicRequestError("tools: Input should be a valid list")
    names: list[str] = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise AnthropicRequestError(f"tools.{index}: Input should be a valid dictionary")
        name = tool.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise AnthropicRequestError(
                f"tools.{index}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'"
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping) or schema.get("type") != "object":
            raise AnthropicRequestError(f"tools.{index}.custom.input_schema.type: Input should be 'object'")
        names.append(name)
    return names
