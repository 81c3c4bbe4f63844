"""The HTTP endpoint: Gemini's `generateContent` REST API playing scripts, plus `/_script/*` controls.

Routes:

- `POST /{version}/models/{model}:generateContent` (any version, e.g. v1 or v1beta)
- `POST /{version}/models/{model}:streamGenerateContent?alt=sse` (the whole turn as one event)
- `GET /_script/calls`: every call and per (conversation, turn) counts, see `CallLedger.snapshot`
- `POST /_script/reset`: clears the call record
- `POST /_script/load`: body is a script file (YAML or JSON); replaces all scripts
- `GET /_script/health`: readiness, with the loaded script names
"""

import argparse
import asyncio
import json
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from scripted_gemini.conversation import RequestError, read_conversation
from scripted_gemini.ledger import CallLedger
from scripted_gemini.player import PlayedTurn, PlayError, play_turn
from scripted_gemini.script import (
    SUPPORT_TRIAGE_SCRIPT,
    ScriptBook,
    ScriptError,
    load_script_file,
    parse_script_text,
)

READY_LINE_PREFIX = "scripted-gemini listening on "
_ACTIONS = ("generateContent", "streamGenerateContent")


class ScriptedGemini:
    """The server's mutable state: the loaded scripts and the call ledger."""

    def __init__(self, book: ScriptBook, clock: Callable[[], float]) -> None:
        self.book = book
        self.ledger = CallLedger(clock)


def build_app(
    scripts: ScriptBook | str | Path | None = None, *, clock: Callable[[], float] = time.time
) -> Starlette:
    """The ASGI app; `scripts` is a loaded book or a script file path (default: support_triage.yaml)."""
    if scripts is None:
        scripts = SUPPORT_TRIAGE_SCRIPT
    book = scripts if isinstance(scripts, ScriptBook) else load_script_file(scripts)
    state = ScriptedGemini(book, clock)

    async def generate(request: Request) -> Response:
        return await _generate(state, request)

    async def calls(_: Request) -> Response:
        return JSONResponse(state.ledger.snapshot())

    async def reset(_: Request) -> Response:
        state.ledger.reset()
        return JSONResponse({"reset": True})

    async def load(request: Request) -> Response:
        text = (await request.body()).decode("utf-8", errors="replace")
        try:
            state.book = parse_script_text(text, source="POST /_script/load")
        except ScriptError as error:
            return gemini_error(400, "INVALID_ARGUMENT", str(error))
        return JSONResponse({"scripts": state.book.names})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "scripts": state.book.names})

    app = Starlette(
        routes=[
            Route("/{version}/models/{target:path}", generate, methods=["POST"]),
            Route("/_script/calls", calls, methods=["GET"]),
            Route("/_script/reset", reset, methods=["POST"]),
            Route("/_script/load", load, methods=["POST"]),
            Route("/_script/health", health, methods=["GET"]),
        ]
    )
    app.state.scripted_gemini = state
    return app


async def _generate(state: ScriptedGemini, request: Request) -> Response:
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
        played = play_turn(state.book, conversation)
    except PlayError as error:
        state.ledger.record(
            conversation=conversation.conversation_id,
            turn=conversation.turn_index,
            model=model,
            script=error.script_name,
            status=400,
            error=error.message,
        )
        return gemini_error(400, "INVALID_ARGUMENT", error.message)

    # Recorded before the delay so a test can see a slow call that is still in flight.
    state.ledger.record(
        conversation=conversation.conversation_id,
        turn=conversation.turn_index,
        model=model,
        script=played.script_name,
        status=200,
        function_calls=played.function_call_names,
        function_responses=tuple(response.name for response in conversation.function_responses),
    )
    if played.delay_ms:
        await asyncio.sleep(played.delay_ms / 1000)
    payload = response_body(
        played, model=model, response_id=f"{conversation.conversation_id}-{conversation.turn_index}"
    )
    if action == "streamGenerateContent":
        event = f"data: {json.dumps(payload, ensure_ascii=False)}\r\n\r\n"
        return StreamingResponse(iter([event]), media_type="text/event-stream")
    return JSONResponse(payload)


def response_body(played: PlayedTurn, *, model: str, response_id: str) -> dict[str, Any]:
    return {
        "candidates": [
            {
                "content": {"role": "model", "parts": list(played.parts)},
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {
            "promptTokenCount": played.prompt_tokens,
            "candidatesTokenCount": played.candidates_tokens,
            "totalTokenCount": played.total_tokens,
        },
        "modelVersion": model,
        "responseId": response_id,
    }


def gemini_error(code: int, status: str, message: str) -> JSONResponse:
    """An error in the shape Google APIs use, which google-genai turns into `errors.APIError`."""
    return JSONResponse({"error": {"code": code, "message": message, "status": status}}, status_code=code)


def _parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="abada-scripted-gemini",
        description="A local Gemini generateContent endpoint that plays scripted conversations.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8766, help="0 picks a free port (printed on stdout)")
    parser.add_argument("--script", type=Path, default=SUPPORT_TRIAGE_SCRIPT, help="YAML or JSON script file")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    arguments = _parse_arguments(argv)
    try:
        app = build_app(arguments.script)
    except ScriptError as error:
        print(f"abada-scripted-gemini: {error}", file=sys.stderr)
        raise SystemExit(2) from error

    # Binding here rather than in uvicorn lets `--port 0` report the real port, and listening
    # before the ready line means no client that read it can be refused.
    listener = socket.socket(socket.AF_INET6 if ":" in arguments.host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((arguments.host, arguments.port))
    listener.listen(128)
    host, port = listener.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    print(f"{READY_LINE_PREFIX}http://{shown_host}:{port}", flush=True)

    config = uvicorn.Config(
        app,
        log_level=arguments.log_level,
        access_log=arguments.log_level in ("info", "debug"),
    )
    uvicorn.Server(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
