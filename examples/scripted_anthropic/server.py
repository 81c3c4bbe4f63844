"""The HTTP endpoint: Anthropic's Messages REST API playing scripts, plus `/_script/*` controls.

Routes:

- `POST /v1/messages`
- `/_script/*`: the controls every scripted endpoint shares (`scripted_gemini.endpoint`)

Replies are what the real API sends: a `message` with `text` and `tool_use` blocks (ids `toolu_…`
stable for a (conversation, turn, position)), `stop_reason` (`tool_use`, `end_turn`, `refusal`)
and `usage` with cache reads apart from `input_tokens`. Errors are `{"type": "error", "error":
{type, message}}`; a scripted rate limit is a 429 `rate_limit_error` with `retry-after`.
"""

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripted_gemini.conversation import Conversation
from scripted_gemini.endpoint import (
    READY_MARKER,
    ScriptedEndpoint,
    control_routes,
    load_book,
    refused_by_outage,
    serve_main,
)
from scripted_gemini.player import PlayedTurn, PlayError, RateLimited, decide
from scripted_gemini.script import ScriptBook
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from scripted_anthropic.conversation import AnthropicRequestError, read_messages_request

READY_LINE_PREFIX = f"scripted-anthropic{READY_MARKER}"


def build_app(
    scripts: ScriptBook | str | Path | None = None, *, clock: Callable[[], float] = time.time
) -> Starlette:
    state = ScriptedEndpoint(load_book(scripts), clock)

    async def messages(request: Request) -> Response:
        return await _messages(state, request)

    app = Starlette(
        routes=[
            Route("/v1/messages", messages, methods=["POST"]),
            *control_routes(
                state, lambda code, message: anthropic_error(code, "invalid_request_error", message)
            ),
        ]
    )
    app.state.scripted_anthropic = state
    return app


_ERROR_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


async def _messages(state: ScriptedEndpoint, request: Request) -> Response:
    refused = refused_by_outage(
        state, lambda code, message: anthropic_error(code, _ERROR_KINDS.get(code, "api_error"), message)
    )
    if refused is not None:
        return refused
    if not request.headers.get("x-api-key") and not request.headers.get("authorization"):
        return anthropic_error(401, "authentication_error", "x-api-key header is required")
    if not request.headers.get("anthropic-version"):
        return anthropic_error(400, "invalid_request_error", "anthropic-version: header is required")
    try:
        body = json.loads(await request.body())
        model, conversation = read_messages_request(body)
    except (ValueError, AnthropicRequestError) as error:
        state.ledger.record(conversation="", turn=-1, model="", script=None, status=400, error=str(error))
        return anthropic_error(400, "invalid_request_error", str(error))
    try:
        played = decide(state.book, state.ledger, conversation, model)
    except PlayError as error:
        return anthropic_error(400, "invalid_request_error", error.message)
    if isinstance(played, RateLimited):
        return anthropic_error(
            429,
            "rate_limit_error",
            "This request would exceed the rate limit for your organization of 1 requests per minute.",
            headers={
                "retry-after": f"{played.retry_after_seconds:g}",
                "anthropic-ratelimit-requests-limit": "1",
                "anthropic-ratelimit-requests-remaining": "0",
            },
        )
    if played.delay_ms:
        await asyncio.sleep(played.delay_ms / 1000)
    return JSONResponse(message_body(played, conversation, model=model))


def tool_use_id(conversation: Conversation, position: int) -> str:
    """Opaque like Anthropic's, yet the same for a replayed turn, so a journal can match calls by id."""
    seed = f"{conversation.conversation_id}/{conversation.turn_index}/{position}".encode()
    return "toolu_" + hashlib.sha256(seed).hexdigest()[:24]


def message_body(played: PlayedTurn, conversation: Conversation, *, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if played.refusal is not None:
        content.append({"type": "text", "text": played.refusal})
        stop_reason = "refusal"
    elif played.calls:
        content += [
            {
                "type": "tool_use",
                "id": tool_use_id(conversation, call.position),
                "name": call.name,
                "input": call.args,
            }
            for call in played.calls
        ]
        stop_reason = "tool_use"
    else:
        content.append({"type": "text", "text": played.text or ""})
        stop_reason = "end_turn"
    return {
        "id": f"msg_{conversation.conversation_id}{conversation.turn_index}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {
            # Anthropic counts cache reads apart: input_tokens is what was not read from the cache.
            "input_tokens": played.prompt_tokens - min(played.cached_tokens, played.prompt_tokens),
            "output_tokens": played.candidates_tokens + played.reasoning_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": min(played.cached_tokens, played.prompt_tokens),
        },
    }


def anthropic_error(
    status: int, kind: str, message: str, *, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"type": "error", "error": {"type": kind, "message": message}, "request_id": "req_scripted"},
        status_code=status,
        headers={"request-id": "req_scripted", **(headers or {})},
    )


def main(argv: list[str] | None = None) -> None:
    serve_main(
        argv,
        name="scripted-anthropic",
        description="A local Anthropic Messages endpoint that plays scripted conversations.",
        default_port=8768,
        build_app=build_app,
    )


if __name__ == "__main__":
    main()
