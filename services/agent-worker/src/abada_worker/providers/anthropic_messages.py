"""Anthropic's Messages API with tool use, through the official `anthropic` SDK's async client.

The SDK's own retries are off, as for OpenAI: a 429 with `retry-after` goes back to the worker,
which waits it out within the attempt; a 529 (overloaded) or a 5xx is an outage the worker waits
out with every other worker (`providers.base.is_outage`).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
from anthropic.types import Message

from .. import conversation
from .base import (
    ModelCallError,
    StainlessProvider,
    error_reply,
    retry_after_seconds,
    sdk_errors,
    wire_history,
)
from .schemas import anthropic_input_schema

# The Messages API requires an output bound per turn; the node's token limit still caps the task.
DEFAULT_MAX_OUTPUT_TOKENS = 4096
_FINISHES = {
    "end_turn": conversation.FINISH_STOP,
    "stop_sequence": conversation.FINISH_STOP,
    "pause_turn": conversation.FINISH_STOP,
    "tool_use": conversation.FINISH_TOOL_CALLS,
    "max_tokens": conversation.FINISH_LENGTH,
    "model_context_window_exceeded": conversation.FINISH_LENGTH,
    "refusal": conversation.FINISH_REFUSAL,
}


class AnthropicMessagesProvider(StainlessProvider[anthropic.AsyncAnthropic]):
    name = "anthropic"
    credential = "ANTHROPIC_API_KEY"

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str | None = None,
        timeout_seconds: float = 120.0,
        max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS,
    ) -> None:
        super().__init__(
            anthropic.AsyncAnthropic,
            "Anthropic",
            api_key=api_key,
            base_url=base_url,
            timeout_seconds=timeout_seconds,
        )
        self._max_output_tokens = max_output_tokens

    async def generate(self, request: conversation.ModelRequest) -> conversation.ModelReply:
        tools = [tool_of(function) for function in request.functions]
        with sdk_errors("Anthropic", anthropic.APIStatusError, _call_error, anthropic.APIError):
            message = await self._client.messages.create(
                model=request.model,
                max_tokens=self._max_output_tokens,
                system=request.system,
                messages=messages_of(request),  # type: ignore[arg-type]
                tools=tools or anthropic.omit,  # type: ignore[arg-type]
            )
        return reply_of(message)


def _call_error(error: anthropic.APIStatusError) -> ModelCallError:
    status = error.status_code
    body = error.body if isinstance(error.body, dict) else {}
    raw_detail = body.get("error")
    detail = raw_detail if isinstance(raw_detail, dict) else {}
    return error_reply(
        "Anthropic",
        status,
        str(detail.get("type") or ""),
        str(detail.get("message") or error.message),
        retry_after_seconds=retry_after_seconds(error.response.headers),
    )


def tool_of(function: conversation.FunctionSpec) -> dict[str, Any]:
    return {
        "name": function.name,
        "description": function.description,
        "input_schema": anthropic_input_schema(function.parameters),
    }


def messages_of(request: conversation.ModelRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": request.user}]
    for turn in wire_history(request.history):
        if isinstance(turn, conversation.ModelTurn):
            messages.append({"role": "assistant", "content": _assistant_blocks(turn)})
        else:
            # Every result of a turn in the one user message right after it, as the API requires.
            messages.append(
                {"role": "user", "content": [_result_block(result, wire_id) for result, wire_id in turn]}
            )
    return messages


def _assistant_blocks(turn: conversation.ModelTurn) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    text = turn.text or turn.refusal
    if text:
        blocks.append({"type": "text", "text": text})
    blocks += [
        {"type": "tool_use", "id": call.wire_id, "name": call.name, "input": call.args}
        for call in turn.function_calls
    ]
    # An assistant message may not be empty; a turn that said nothing is shown as such.
    return blocks or [{"type": "text", "text": "(no reply)"}]


def _result_block(result: conversation.FunctionResult, wire_id: str) -> dict[str, Any]:
    value = conversation.result_for_model(result.result)
    return {
        "type": "tool_result",
        "tool_use_id": wire_id,
        "content": value if isinstance(value, str) else json.dumps(value, ensure_ascii=False),
        "is_error": result.is_error,
    }


def reply_of(message: Message) -> conversation.ModelReply:
    texts: list[str] = []
    calls: list[conversation.FunctionCall] = []
    for block in message.content:
        if block.type == "text":
            texts.append(block.text)
        elif block.type == "tool_use":
            calls.append(
                conversation.FunctionCall(id=block.id, name=block.name, args=dict(block.input or {}))
            )
    stop = str(message.stop_reason or "")
    usage = message.usage
    cache_read = usage.cache_read_input_tokens or 0
    cache_write = usage.cache_creation_input_tokens or 0
    refused = stop == "refusal"
    text = "".join(texts)
    details = getattr(usage, "output_tokens_details", None)
    return conversation.ModelReply(
        text="" if refused else text,
        function_calls=() if refused else tuple(calls),
        finish_reason=stop,
        # Anthropic counts cached and cache-writing input apart from `input_tokens`; all were read.
        input_tokens=usage.input_tokens + cache_read + cache_write,
        output_tokens=usage.output_tokens,
        finish=conversation.neutral_finish(stop, _FINISHES),
        refusal=(text or "the model declined to answer") if refused else "",
        cached_input_tokens=cache_read,
        reasoning_tokens=int(getattr(details, "thinking_tokens", 0) or 0) if details else 0,
    )
