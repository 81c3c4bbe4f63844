"""The HTTP endpoint: OpenAI's Chat Completions REST API playing scripts, plus `/_script/*` controls.

Routes:

- `POST /v1/chat/completions` (and `/chat/completions`, for a base URL given without `/v1`)
- `/_script/*`: the controls every scripted endpoint shares (`scripted_gemini.endpoint`)

Replies are what the real API sends: a `chat.completion` object with `tool_calls` (arguments as a
JSON string, ids `call_…` stable for a (conversation, turn, position)), `refusal`, `finish_reason`
and `usage` with cached and reasoning token details. Errors are `{"error": {message, type, param,
code}}`; a scripted rate limit is a 429 `rate_limit_exceeded` with `retry-after`.
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

from scripted_openai.conversation import OpenAIRequestError, read_chat_request

READY_LINE_PREFIX = f"scripted-openai{READY_MARKER}"


def build_app(
    scripts: ScriptBook | str | Path | None = None, *, clock: Callable[[], float] = time.time
) -> Starlette:
    state = ScriptedEndpoint(load_book(scripts), clock)

    async def completions(request: Request) -> Response:
        return await _completions(state, request, clock)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/chat/completions", completions, methods=["POST"]),
            *control_routes(state, lambda code, message: openai_error(code, message)),
        ]
    )
    app.state.scripted_openai = state
    return app


async def _completions(state: ScriptedEndpoint, request: Request, clock: Callable[[], float]) -> Response:
    refused = refused_by_outage(state, lambda code, message: openai_error(code, message))
    if refused is not None:
        return refused
    if not request.headers.get("authorization", "").startswith("Bearer "):
        return openai_error(
            401,
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            code=None,
        )
    try:
        body = json.loads(await request.body())
        model, conversation = read_chat_request(body)
    except OpenAIRequestError as error:
        state.ledger.record(conversation="", turn=-1, model="", script=None, status=400, error=str(error))
        return openai_error(400, str(error), param=error.param)
    except ValueError as error:
        state.ledger.record(conversation="", turn=-1, model="", script=None, status=400, error=str(error))
        return openai_error(400, "We could not parse the JSON body of your request.")
    try:
        played = decide(state.book, state.ledger, conversation, model)
    except PlayError as error:
        return openai_error(400, error.message)
    if isinstance(played, RateLimited):
        return rate_limited(model, played.retry_after_seconds)
    if played.delay_ms:
        await asyncio.sleep(played.delay_ms / 1000)
    return JSONResponse(completion_body(played, conversation, model=model, created=int(clock())))


def call_id(conversation: Conversation, position: int) -> str:
    """Opaque like OpenAI's, yet the same for a replayed turn, so a journal can match calls by id."""
    seed = f"{conversation.conversation_id}/{conversation.turn_index}/{position}".encode()
    return "call_" + hashlib.sha256(seed).hexdigest()[:24]


def completion_body(
    played: PlayedTurn, conversation: Conversation, *, model: str, created: int
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": played.text, "refusal": played.refusal}
    if played.calls:
        message["tool_calls"] = [
            {
                "id": call_id(conversation, call.position),
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.args, ensure_ascii=False)},
            }
            for call in played.calls
        ]
    completion_tokens = played.candidates_tokens + played.reasoning_tokens
    return {
        "id": f"chatcmpl-{conversation.conversation_id}{conversation.turn_index}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": "fp_scripted",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if played.calls else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": played.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": played.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": played.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": played.reasoning_tokens, "audio_tokens": 0},
        },
    }


def openai_error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": code}},
        status_code=status,
        headers=headers,
    )


def rate_limited(model: str, retry_after_seconds: float) -> JSONResponse:
    return openai_error(
        429,
        f"Rate limit reached for {model} on requests per min (RPM): Limit 1, Used 1, Requested 1. "
        f"Please try again in {retry_after_seconds:g}s.",
        kind="requests",
        code="rate_limit_exceeded",
        headers={
            "retry-after": f"{retry_after_seconds:g}",
            "x-ratelimit-limit-requests": "1",
            "x-ratelimit-remaining-requests": "0",
            "x-ratelimit-reset-requests": f"{retry_after_seconds:g}s",
        },
    )


def main(argv: list[str] | None = None) -> None:
    serve_main(
        argv,
        name="scripted-openai",
        description="A local OpenAI Chat Completions endpoint that plays scripted conversations.",
        default_port=8767,
        build_app=build_app,
    )


if __name__ == "__main__":
    main()
