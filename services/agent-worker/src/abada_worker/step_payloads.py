"""The shapes of the journal's request and response payloads, which only the worker reads.

MODEL_CALL  request  {"turn": n, "model": m}
            response {"text": ..., "functionCalls": [{"id", "name", "args", "thoughtSignature"?,
                      "providerId"?}], "finishReason": ...}; `id` is unique in its turn (assigned by
                      the worker when the model gave none), `providerId` the model's own when it differs
TOOL_CALL   request  {"callId", "name" (server__tool), "arguments"}
            response the MCP CallToolResult as JSON {"content": [...], "structuredContent": ..., "isError"}
            AWAITING_APPROVAL (a call of a tool under approval, proposed, never sent): the request
            also carries "modelText", what the model said in that turn, for the person deciding.
            The engine then writes APPROVED with response {"approval": {"arguments", ...}} (the
            call runs at a new sequence with those arguments) or COMPLETED with the rejection as
            a CallToolResult error ("rejected by a person: <reason>").

Tool errors are stored as FAILED steps with the same CallToolResult shape, so a replay hands the
model the same error it saw the first time.
"""

from __future__ import annotations

from typing import Any

from .conversation import FunctionCall, ModelReply, ModelTurn


def model_request(turn: int, model: str) -> dict[str, Any]:
    return {"turn": turn, "model": model}


def model_response(reply: ModelReply) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []
    for call in reply.function_calls:
        entry: dict[str, Any] = {"id": call.id, "name": call.name, "args": call.args}
        if call.signature:
            entry["thoughtSignature"] = call.signature
        if call.provider_id is not None:
            entry["providerId"] = call.provider_id
        calls.append(entry)
    return {**reply.extra, "text": reply.text, "functionCalls": calls, "finishReason": reply.finish_reason}


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
    return ModelTurn(text=str(response.get("text") or ""), function_calls=calls)


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
