"""Gemini through google-genai's async client, with function calling and nothing automatic.

The worker executes no function on the model's behalf inside the SDK: automatic function calling is
off, every call comes back to the agent loop, which journals it. `ABADA_GEMINI_BASE_URL` points the
same client at the scripted endpoint used by tests and the offline demo.
"""

from __future__ import annotations

import base64
from typing import Any

from abada_common.capped_http import capped_client
from google import genai
from google.genai import errors, types

from .. import conversation
from .base import ModelCallError, error_reply, key_or_placeholder, sdk_errors, wire_history

_FINISHES = {
    "STOP": conversation.FINISH_STOP,
    "MAX_TOKENS": conversation.FINISH_LENGTH,
    **dict.fromkeys(
        ("SAFETY", "RECITATION", "BLOCKLIST", "PROHIBITED_CONTENT", "SPII", "IMAGE_SAFETY", "MODEL_ARMOR"),
        conversation.FINISH_FILTERED,
    ),
}
# A key the scripted endpoint ignores; the SDK refuses to start without one.
_PLACEHOLDER_KEY = "scripted-endpoint"


class GeminiProvider:
    name = "gemini"
    credential = "GEMINI_API_KEY"

    def __init__(
        self,
        *,
        api_key: str | None,
        base_url: str | None = None,
        timeout_seconds: float = 120.0,
    ) -> None:
        key = key_or_placeholder(
            "Gemini",
            self.credential,
            api_key=api_key,
            base_url=base_url,
            placeholder=_PLACEHOLDER_KEY,
            instead="ABADA_GEMINI_BASE_URL for a scripted endpoint",
        )
        options = types.HttpOptions(
            base_url=base_url or None,
            timeout=int(timeout_seconds * 1000),
            # One try per call: the worker waits out an outage with every other worker, through the
            # engine's circuit, instead of each SDK retrying on its own (`dependencies`).
            retry_options=types.HttpRetryOptions(attempts=1),
            httpx_async_client=capped_client(),
        )
        self._client = genai.Client(api_key=key, http_options=options).aio

    async def generate(self, request: conversation.ModelRequest) -> conversation.ModelReply:
        config = types.GenerateContentConfig(
            system_instruction=request.system,
            tools=[types.Tool(function_declarations=[_declaration(f) for f in request.functions])]
            if request.functions
            else None,
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
        )
        # Whatever the transport raised, there is no reply.
        with sdk_errors("Gemini", errors.APIError, _call_error, Exception):
            response = await self._client.models.generate_content(
                model=request.model, contents=contents_of(request), config=config
            )
        return reply_of(response)

    async def aclose(self) -> None:
        await self._client.aclose()


def _call_error(error: errors.APIError) -> ModelCallError:
    return error_reply(
        "Gemini",
        error.code,
        error.status or "",
        error.message or "",
        retry_after_seconds=retry_delay_of(error),
    )


def _declaration(function: conversation.FunctionSpec) -> types.FunctionDeclaration:
    return types.FunctionDeclaration(
        name=function.name, description=function.description, parameters_json_schema=function.parameters
    )


def contents_of(request: conversation.ModelRequest) -> list[types.Content]:
    contents = [types.Content(role="user", parts=[types.Part.from_text(text=request.user)])]
    for turn in wire_history(request.history):
        if isinstance(turn, conversation.ModelTurn):
            parts: list[types.Part] = [types.Part(text=turn.text)] if turn.text else []
            parts += [_call_part(call) for call in turn.function_calls]
            contents.append(types.Content(role="model", parts=parts))
        else:
            responses = [_response_part(result, wire_id) for result, wire_id in turn]
            contents.append(types.Content(role="user", parts=responses))
    return contents


def _call_part(call: conversation.FunctionCall) -> types.Part:
    return types.Part(
        function_call=types.FunctionCall(id=call.wire_id or None, name=call.name, args=call.args),
        thought_signature=base64.b64decode(call.signature) if call.signature else None,
    )


def _response_part(result: conversation.FunctionResult, wire_id: str) -> types.Part:
    # Gemini reads "output" as a function's result and "error" as its failure.
    key = "error" if result.is_error else "output"
    return types.Part(
        function_response=types.FunctionResponse(
            id=wire_id or None, name=result.name, response={key: conversation.result_for_model(result.result)}
        )
    )


def reply_of(response: types.GenerateContentResponse) -> conversation.ModelReply:
    candidate = response.candidates[0] if response.candidates else None
    parts = candidate.content.parts if candidate and candidate.content and candidate.content.parts else []
    texts: list[str] = []
    calls: list[conversation.FunctionCall] = []
    for part in parts:
        if part.function_call is not None:
            signature = base64.b64encode(part.thought_signature).decode() if part.thought_signature else ""
            call = part.function_call
            calls.append(
                conversation.FunctionCall(
                    id=call.id or "", name=call.name or "", args=dict(call.args or {}), signature=signature
                )
            )
        elif part.text and not part.thought:
            texts.append(part.text)
    usage = response.usage_metadata
    input_tokens = (usage.prompt_token_count or 0) if usage else 0
    reasoning_tokens = (usage.thoughts_token_count or 0) if usage else 0
    output_tokens = ((usage.candidates_token_count or 0) + reasoning_tokens) if usage else 0
    finish = candidate.finish_reason.value if candidate and candidate.finish_reason is not None else ""
    extra: dict[str, Any] = {}
    blocked = ""
    if response.prompt_feedback and response.prompt_feedback.block_reason:
        blocked = str(response.prompt_feedback.block_reason.value)
        extra["blockReason"] = blocked
    return conversation.ModelReply(
        text="".join(texts),
        function_calls=tuple(calls),
        finish_reason=finish,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        extra=extra,
        finish=conversation.FINISH_FILTERED if blocked else _neutral_finish(finish, bool(calls)),
        cached_input_tokens=(usage.cached_content_token_count or 0) if usage else 0,
        reasoning_tokens=reasoning_tokens,
    )


def _neutral_finish(finish: str, called: bool) -> str:
    # Gemini ends a turn that calls functions with STOP, as it ends an answer.
    return conversation.FINISH_TOOL_CALLS if called else conversation.neutral_finish(finish, _FINISHES)


def retry_delay_of(error: errors.APIError) -> float | None:
    """The wait an error asks for (a quota error, an overloaded service): Gemini puts a
    google.rpc.RetryInfo (`retryDelay: "30s"`) in the error's details; an HTTP Retry-After header
    says the same for other gateways."""
    body = error.details if isinstance(error.details, dict) else {}
    for detail in (body.get("error") or {}).get("details") or []:
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return float(delay[:-1])
            except ValueError:
                pass
    headers = getattr(error.response, "headers", None)
    header = headers.get("retry-after") if headers is not None else None
    if header:
        try:
            return float(header)
        except ValueError:
            return None
    return None
