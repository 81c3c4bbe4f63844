"""What every scripted model endpoint shares: its state, the `/_script/*` routes and `main`.

The scripted Gemini, OpenAI and Anthropic endpoints differ only in how they read a request into a
`Conversation` and how they write a reply or an error; the scripts, the turn choice (`player`)
and the call ledger are the same, so a script plays identically whichever API asks.

- `GET /_script/calls`: every call and per (conversation, turn) counts, see `CallLedger.snapshot`
- `POST /_script/reset`: clears the call record
- `POST /_script/load`: body is a script file (YAML or JSON); replaces all scripts
- `GET /_script/health`: readiness, with the loaded script names
- `POST /_script/outage`: `{"status": 503, "retry_after_seconds": 2}` answers every model request
  with that status until `{"status": 0}` ends it (each one recorded in the ledger)
"""

import argparse
import json
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from scripted_gemini.ledger import CallLedger
from scripted_gemini.script import (
    SUPPORT_TRIAGE_SCRIPT,
    ScriptBook,
    ScriptError,
    load_script_file,
    parse_script_text,
)

# Every endpoint prints "<name> listening on http://HOST:PORT" once it accepts connections.
READY_MARKER = " listening on "

ErrorResponse = Callable[[int, str], Response]


@dataclass(frozen=True)
class Outage:
    """Every model request is answered with `status` (a 503 overload, a 401 rejected key, ...)."""

    status: int
    retry_after_seconds: float | None = None


class ScriptedEndpoint:
    """The server's mutable state: the loaded scripts, the call ledger and an outage, if one is on."""

    def __init__(self, book: ScriptBook, clock: Callable[[], float] = time.time) -> None:
        self.book = book
        self.ledger = CallLedger(clock)
        self.outage: Outage | None = None


def refused_by_outage(state: ScriptedEndpoint, error: ErrorResponse) -> Response | None:
    """While an outage is on, a model request is answered with its status in the API's own error
    shape (and a Retry-After when the outage names one); the ledger records it like any call."""
    outage = state.outage
    if outage is None:
        return None
    state.ledger.record(
        conversation="", turn=-1, model="", script=None, status=outage.status, error="scripted outage"
    )
    response = error(
        outage.status, _OUTAGE_MESSAGES.get(outage.status, "the service failed; try again later")
    )
    if outage.retry_after_seconds is not None:
        response.headers["retry-after"] = f"{outage.retry_after_seconds:g}"
    return response


_OUTAGE_MESSAGES = {
    401: "the API key was rejected",
    403: "the API key may not use this model",
    503: "the service is overloaded; try again later",
    529: "overloaded",
}


def load_book(scripts: ScriptBook | str | Path | None) -> ScriptBook:
    if scripts is None:
        scripts = SUPPORT_TRIAGE_SCRIPT
    return scripts if isinstance(scripts, ScriptBook) else load_script_file(scripts)


def control_routes(state: ScriptedEndpoint, bad_request: ErrorResponse) -> list[BaseRoute]:
    """The `/_script/*` routes; `bad_request(400, message)` answers a bad script in the API's shape."""

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
            return bad_request(400, str(error))
        return JSONResponse({"scripts": state.book.names})

    async def outage(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
            status = int(body.get("status", 0))
            retry_after = body.get("retry_after_seconds")
            outage_on = (
                Outage(status, None if retry_after is None else float(retry_after)) if status else None
            )
        except (ValueError, TypeError, AttributeError) as error:
            return bad_request(
                400, f"POST /_script/outage takes {{'status': 503, 'retry_after_seconds': 2}}: {error}"
            )
        if outage_on is not None and not 400 <= outage_on.status <= 599:
            return bad_request(400, "an outage answers a 4xx or 5xx status")
        state.outage = outage_on
        return JSONResponse({"outage": None if outage_on is None else outage_on.status})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "scripts": state.book.names})

    return [
        Route("/_script/calls", calls, methods=["GET"]),
        Route("/_script/reset", reset, methods=["POST"]),
        Route("/_script/load", load, methods=["POST"]),
        Route("/_script/health", health, methods=["GET"]),
        Route("/_script/outage", outage, methods=["POST"]),
    ]


def serve_main(
    argv: list[str] | None,
    *,
    name: str,
    description: str,
    default_port: int,
    build_app: Callable[[Path], Starlette],
) -> None:
    parser = argparse.ArgumentParser(prog=f"abada-{name}", description=description)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=default_port, help="0 picks a free port (printed on stdout)"
    )
    parser.add_argument("--script", type=Path, default=SUPPORT_TRIAGE_SCRIPT, help="YAML or JSON script file")
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    arguments = parser.parse_args(argv)
    try:
        app = build_app(arguments.script)
    except ScriptError as error:
        print(f"abada-{name}: {error}", file=sys.stderr)
        raise SystemExit(2) from error

    # Binding here rather than in uvicorn lets `--port 0` report the real port, and listening
    # before the ready line means no client that read it can be refused.
    listener = socket.socket(socket.AF_INET6 if ":" in arguments.host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((arguments.host, arguments.port))
    listener.listen(128)
    host, port = listener.getsockname()[:2]
    shown_host = f"[{host}]" if ":" in host else host
    print(f"{name}{READY_MARKER}http://{shown_host}:{port}", flush=True)

    config = uvicorn.Config(
        app,
        log_level=arguments.log_level,
        access_log=arguments.log_level in ("info", "debug"),
    )
    uvicorn.Server(config).run(sockets=[listener])
