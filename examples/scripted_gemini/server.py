"""The HTTP endpoint: Gemini's `generateContent` REST API playing scripts, plus `/_script/*` controls.

Routes:

- `POST /{version}/models/{model}:generateContent` (any version, e.g. v1 or v1beta)
- `POST /{version}/models/{model}:streamGenerateContent?alt=sse` (the whole turn as one event)
- `/_script/*`: the controls every scripted endpoint shares (`endpoint`)
"""

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scripted_gemini.conversation import RequestError, read_conversation
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

READY_LINE_PREFIX = f"scripted-gemini{READY_MARKER}"
_ACTIONS = ("generateContent", "streamGenerateContent")


def build_app(
    scripts: ScriptBook | str | Path | None = None, *, clock: Callable[[], float] = time.time
) -> Starlette:
    """The ASGI app; `scripts` is a loaded book or a script file path (default: support_triage.yaml)."""
    state = ScriptedEndpoint(load_book(scripts), clock)

    async def generate(request: Request) -> Response:
        return await _generate(state, request)

    app = Starlette(
        routes=[
            Route("/{version}/models/{target:path}", generate, methods=["POST"]),
            *control_routes(state, lambda code, message: gemini_error(code, "INVALID_ARGUMENT", message)),
        ]
    )
    app.state.scripted_gemini = state
    return app


_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}


def gemini_error_for(code: int, message: str) -> JSONResponse:
    return gemini_error(code, _STATUS_NAMES.get(code, "UNKNOWN"), message)


async def _generate(state: ScriptedEndpoint, request: Request) -> Response:
    refused = refused_by_outage(state, gemini_error_for)
    if refused is not None:
        return refused
    model, _, action = request.path_params["target"].rpartition(":")
    if action not in _ACTIONS or not model:
        return gemini_error(404, "NOT_FOUND", f"scripted Gemini serves only {' and '.join(_ACTIONS)}")
    try:
        body = json.loads(await request.body())
        conversation = read_conversation(body)
    except (ValueError, RequestError) as error:
        state.ledger.record(conversation="", turn=-1, model=model, script=None, status=400, error=str(error))
        return gemini_error(400, "INVALID_ARGUMENT", f"invalid generateContent request: {error}")

    try:
        played = decide(state.book, state.ledger, conversation, model)
    except PlayError as error:
        return gemini_error(400, "INVALID_ARGUMENT", error.message)
    if isinstance(played, RateLimited):
        return rate_limited(played.retry_after_seconds)
    if played.delay_ms:
        await asyncio.sleep(played.delay_ms / 1000)
    payload = response_body(
        played,
        model=model,
        response_id=f"{conversation.conversation_id}-{conversation.turn_index}",
        turn_index=conversation.turn_index,
    )
    if action == "streamGenerateContent":
        event = f"data: {json.dumps(payload, ensure_ascii=False)}\r\n\r\n"
        return StreamingResponse(iter([event]), media_type="text/event-stream")
    return JSONResponse(payload)


def parts_of(played: PlayedTurn, turn_index: int) -> list[dict[str, Any]]:
    """Gemini `Part` objects, camelCase, ready for the wire."""
    if played.calls:
        return [
            {
                "functionCall": {
                    # Stable across replays of the same turn, so a journal can match calls by id.
                    "id": f"call_{turn_index}_{call.position}",
                    "name": call.name,
                    "args": call.args,
                }
            }
            for call in played.calls
        ]
    return [{"text": played.text or ""}] if played.refusal is None else []


def response_body(played: PlayedTurn, *, model: str, response_id: str, turn_index: int = 0) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "promptTokenCount": played.prompt_tokens,
        "candidatesTokenCount": played.candidates_tokens,
        "totalTokenCount": played.total_tokens + played.reasoning_tokens,
    }
    if played.cached_tokens:
        usage["cachedContentTokenCount"] = played.cached_tokens
    if played.reasoning_tokens:
        usage["thoughtsTokenCount"] = played.reasoning_tokens
    return {
        "candidates": [
            {
                "content": {"role": "model", "parts": parts_of(played, turn_index)},
                # Gemini has no refusal of its own; a declined answer comes back filtered.
                "finishReason": "STOP" if played.refusal is None else "SAFETY",
                "index": 0,
            }
        ],
        "usageMetadata": usage,
        "modelVersion": model,
        "responseId": response_id,
    }


def gemini_error(code: int, status: str, message: str) -> JSONResponse:
    """An error in the shape Google APIs use, which google-genai turns into `errors.APIError`."""
    return JSONResponse({"error": {"code": code, "message": message, "status": status}}, status_code=code)


def rate_limited(retry_after_seconds: float) -> JSONResponse:
    """Gemini's 429: RESOURCE_EXHAUSTED with a google.rpc.RetryInfo saying when to come back."""
    body = {
        "error": {
            "code": 429,
            "message": "Resource has been exhausted (e.g. check quota).",
            "status": "RESOURCE_EXHAUSTED",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.RetryInfo",
                    "retryDelay": f"{retry_after_seconds:g}s",
                }
            ],
        }
    }
    return JSONResponse(body, status_code=429)


def main(argv: list[str] | None = None) -> None:
    serve_main(
        argv,
        name="scripted-gemini",
        description="A local Gemini generateContent endpoint that plays scripted conversations.",
        default_port=8766,
        build_app=build_app,
    )


if __name__ == "__main__":
    main()
