"""The shapes of the journal's request and response payloads, which only the worker reads.

What the journal holds of a model turn is provider-neutral: enough to show the turn back to the
same provider on any worker (the conversation is rebuilt from it, see `replay`), and nothing of
any provider's wire format beyond the opaque state it asks to be handed back.

MODEL_CALL  request  {"turn": n, "model": m, "provider": "gemini" | "openai" | "anthropic"}
            response {
              "text":          the model's text ("" when it only called functions),
              "functionCalls": [{"id", "name" (server__tool), "args" (a JSON object),
                                 "thoughtSignature"? (Gemini's opaque state, base64),
                                 "providerId"? (the model's own id when the worker had to assign
                                 `id`; Gemini often gives none)}], in the model's order: several
                               in one turn are parallel calls, run in that order, their results
                               shown back together,
              "finishReason":  the provider's own word (STOP, tool_calls, end_turn, ...),
              "finish":        the same in neutral words: stop | tool_calls | length | refusal |
                               content_filter | other,
              "refusal"?:      what the model said when it declined (OpenAI `refusal`, Anthropic
                               `stop_reason: refusal`); such a turn ends the task as invalid output,
              "usage"?:        {"cachedInputTokens", "reasoningTokens"} where the provider reports
                               them (the step's own tokens hold input and output, reasoning included),
              provider notes:  "blockReason" (Gemini), "systemFingerprint" (OpenAI), for people only
            }
            `id` is unique in its turn; tool steps name the call they answer by it.
TOOL_CALL   request  {"callId", "name" (server__tool), "arguments"}
            response the MCP CallToolResult as JSON {"content": [...], "structuredContent": ..., "isError"}
            AWAITING_APPROVAL (a call of a tool under approval, proposed, never sent): the request
            also carries "modelText", what the model said in that turn, for the person deciding.
            The engine then writes APPROVED with response {"approval": {"arguments", ...}} (the
            call runs at a new sequence with those arguments) or COMPLETED with the rejection as
            a CallToolResult error ("rejected by a person: <reason>").

Never in the journal: API keys, request headers, the provider's raw response. Tool errors are
stored as FAILED steps with the same CallToolResult shape, so a replay hands the model the same
error it saw the first time. A rate-limited model call stays STARTED while the worker waits and
is COMPLETED at the same sequence once the provider answers.
"""

from __future__ import annotations

import json
from typing import Any

from .conversation import FunctionCall, ModelReply, ModelTurn


def model_request(turn: int, model: str, provider: str) -> dict[str, Any]:
    return {"turn": turn, "model": model, "provider": provider}


# The engine refuses a journal payload over 1,000,000 bytes as JSON; a reply is cut well before that.
MAX_MODEL_REPLY_BYTES = 900_000
# What is kept of a reply's text once it is cut.
TRUNCATED_TEXT_CHARS = 4_000


def model_response_within_limit(reply: ModelReply) -> tuple[dict[str, Any], int | None]:
    """The reply's journal payload, and None; or, when it is larger than the journal takes, a
    truncated payload (the start of the text, no function calls, what was cut) and its full size."""
    response = model_response(reply)
    size = len(json.dumps(response, ensure_ascii=False).encode())
    if size <= MAX_MODEL_REPLY_BYTES:
        return response, None
    truncated = {
        "text": reply.text[:TRUNCATED_TEXT_CHARS],
        "functionCalls": [],
        "finishReason": reply.finish_reason,
        "finish": reply.finish,
        "truncated": {"bytes": size, "functionCalls": len(reply.function_calls)},
    }
    return truncated, size


def model_response(reply: ModelReply) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []
    for call in reply.function_calls:
        entry: dict[str, Any] = {"id": call.id, "name": call.name, "args": call.args}
        if call.signature:
            entry["thoughtSignature"] = call.signature
        if call.provider_id is not None:
            entry["providerId"] = call.provider_id
        calls.append(entry)
    response: dict[str, Any] = {
        **reply.extra,
        "text": reply.text,
        "functionCalls": calls,
        "finishReason": reply.finish_reason,
        "finish": reply.finish,
    }
    if reply.refusal:
        response["refusal"] = reply.refusal
    if reply.cached_input_tokens or reply.reasoning_tokens:
        response["usage"] = {
            "cachedInputTokens": reply.cached_input_tokens,
            "reasoningTokens": reply.reasoning_tokens,
        }
    return response


def usage_of(response: dict[str, Any]) -> tuple[int, int]:
    """(cached input tokens, reasoning tokens) of a journaled model turn."""
    usage = response.get("usage") or {}
    return int(usage.get("cachedInputTokens") or 0), int(usage.get("reasoningTokens") or 0)


def model_turn_of(response: dict[str, Any]) -> ModelTurn:
    calls = tuple(
        FunctionCall(
            id=str(call.get("id", "")),
            name=str(call.get("name", "")),
            args=dict(call.get("args") or {}),
            signature=str(call.get("thoughtSignature", "")),
            provider_id=str(call["providerId"]) if "providerId" in call else None,
        )
        for call in response.get("functionCalls") or []
    )
    return ModelTurn(
        text=str(response.get("text") or ""), function_calls=calls, refusal=str(response.get("refusal") or "")
    )


def tool_request(call: FunctionCall) -> dict[str, Any]:
    return {"callId": call.id, "name": call.name, "arguments": call.args}


def proposed_call_request(call: FunctionCall, model_text: str) -> dict[str, Any]:
    return {**tool_request(call), "modelText": model_text}


def approved_arguments_of(response: dict[str, Any]) -> dict[str, Any] | None:
    """The arguments a person approved, from an APPROVED step's response (None if it has none)."""
    approval = response.get("approval")
    if not isinstance(approval, dict) or not isinstance(approval.get("arguments"), dict):
        return None
    return dict(approval["arguments"])


def call_id_of(request: dict[str, Any]) -> str:
    return str(request.get("callId", ""))


def error_result(message: str) -> dict[str, Any]:
    """A CallToolResult for an error the worker itself reports to the model."""
    return {"content": [{"type": "text", "text": message}], "isError": True}


def unknown_function_result(name: str, declared: frozenset[str]) -> dict[str, Any]:
    """What the model is told when it asks for a function it was not given.

    Never journaled (the engine accepts only bound tools), so it must come out the same on replay.
    """
    return error_result(
        f"There is no function named {name!r}. The declared functions are: {', '.join(sorted(declared))}."
    )
