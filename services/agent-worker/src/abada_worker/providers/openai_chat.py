"""OpenAI's Chat Completions API with tools, through the official `openai` SDK's async client.

One client serves OpenAI itself and every server speaking the same API (Azure OpenAI's v1
endpoint, vLLM, Ollama, gateways): only `base_url` differs. The SDK's own retries are off:
a rate limit goes back to the worker, which waits out `retry-after` with the lease kept alive
and records the wait; an outage (5xx, a lost connection) is waited out with every other worker
(`providers.base.is_outage`); any other failure ends the attempt.
"""

from __future__ import annotations

import json
from typing import Any

import openai
from openai.types.chat import ChatCompletion

from .. import conversation
from .base import (
    ModelCallError,
    StainlessProvider,
    error_reply,
    retry_after_seconds,
    sdk_errors,
    wire_history,
)
from .schemas import openai_parameters

# Where arguments the model produced that are not a JSON object go, so the tool's own input
# validation answers the model (as an error it can correct) instead of the worker guessing.
INVALID_ARGUMENTS_KEY = "_invalid_arguments"
_FINISHES = {
    "stop": conversation.FINISH_STOP,
    "tool_calls": conversation.FINISH_TOOL_CALLS,
    "function_call": conversation.FINISH_TOOL_CALLS,
    "length": conversation.FINISH_LENGTH,
    "content_filter": conversation.FINISH_FILTERED,
}


class OpenAIChatProvider(StainlessProvider[openai.AsyncOpenAI]):
    name = "openai"
    credential = "OPENAI_API_KEY"

    def __init__(
        self, *, api_key: str | None, base_url: str | None = None, timeout_seconds: float = 120.0
    ) -> None:
        super().__init__(
            openai.AsyncOpenAI, "OpenAI", api_key=api_key, base_url=base_url, timeout_seconds=timeout_seconds
        )

    async def generate(self, request: conversation.ModelRequest) -> conversation.ModelReply:
        tools = [tool_of(function) for function in request.functions]
        with sdk_errors("OpenAI", openai.APIStatusError, _call_error, openai.APIError):
            completion = await self._client.chat.completions.create(
                model=request.model,
                messages=messages_of(request),  # type: ignore[arg-type]
                tools=tools or openai.omit,  # type: ignore[arg-type]
            )
        return reply_of(completion)


def _call_error(error: openai.APIStatusError) -> ModelCallError:
    status = error.status_code
    body = error.body if isinstance(error.body, dict) else {}
    code = str(body.get("code") or "")
    # A 429 for an exhausted billing quota will not clear by waiting; a rate limit will.
    quota_gone = code == "insufficient_quota"
    return error_reply(
        "OpenAI",
        status,
        code,
        str(body.get("message") or error.message),
        retry_after_seconds=retry_after_seconds(error.response.headers) if not quota_gone else None,
        retryable=not quota_gone,
    )


def tool_of(function: conversation.FunctionSpec) -> dict[str, Any]:
    parameters, strict = openai_parameters(function.parameters)
    return {
        "type": "function",
        "function": {
            "name": function.name,
            "description": function.description,
            "parameters": parameters,
            "strict": strict,
        },
    }


def messages_of(request: conversation.ModelRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": request.system},
        {"role": "user", "content": request.user},
    ]
    for turn in wire_history(request.history):
        if isinstance(turn, conversation.ModelTurn):
            messages.append(_assistant_message(turn))
        else:
            messages += [_tool_message(result, wire_id) for result, wire_id in turn]
    return messages


def _assistant_message(turn: conversation.ModelTurn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
    if turn.refusal:
        message["refusal"] = turn.refusal
    if turn.function_calls:
        message["tool_calls"] = [
            {
                "id": call.wire_id,
                "type": "function",
                "function": {"name": call.name, "arguments": _arguments_text(call.args)},
            }
            for call in turn.function_calls
        ]
    return message


def _arguments_text(args: dict[str, Any]) -> str:
    written = args.get(INVALID_ARGUMENTS_KEY)
    if set(args) == {INVALID_ARGUMENTS_KEY} and isinstance(written, str):
        return written  # what the model wrote, shown back unchanged
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _tool_message(result: conversation.FunctionResult, wire_id: str) -> dict[str, Any]:
    # Chat Completions has no error flag on a tool message; the error is said in the content.
    value = conversation.result_for_model(result.result)
    content = {"error": value} if result.is_error else value
    return {
        "role": "tool",
        "tool_call_id": wire_id,
        "content": content if isinstance(content, str) else json.dumps(content, ensure_ascii=False),
    }


def reply_of(completion: ChatCompletion) -> conversation.ModelReply:
    if not completion.choices:
        raise ModelCallError("OpenAI answered without a choice", retryable=True)
    choice = completion.choices[0]
    message = choice.message
    calls = tuple(
        conversation.FunctionCall(
            id=call.id, name=call.function.name, args=_arguments_of(call.function.arguments)
        )
        for call in message.tool_calls or ()
        if call.type == "function"
    )
    usage = completion.usage
    prompt_details = usage.prompt_tokens_details if usage else None
    completion_details = usage.completion_tokens_details if usage else None
    refusal = message.refusal or ""
    finish = str(choice.finish_reason or "")
    extra: dict[str, Any] = {}
    if completion.system_fingerprint:
        extra["systemFingerprint"] = completion.system_fingerprint
    return conversation.ModelReply(
        text=message.content or "",
        function_calls=calls,
        finish_reason=finish,
        input_tokens=usage.prompt_tokens if usage else 0,
        output_tokens=usage.completion_tokens if usage else 0,
        extra=extra,
        finish=conversation.FINISH_REFUSAL if refusal else conversation.neutral_finish(finish, _FINISHES),
        refusal=refusal,
        cached_input_tokens=(prompt_details.cached_tokens or 0) if prompt_details else 0,
        reasoning_tokens=(completion_details.reasoning_tokens or 0) if completion_details else 0,
    )


def _arguments_of(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {INVALID_ARGUMENTS_KEY: text}
