"""Assembles the CRM: MCP at /mcp, the ticket listing, the optional test control, all behind bearer auth."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio.to_thread
from mcp.server.mcpserver import MCPServer
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp

from crm_mcp.auth import BearerAuthMiddleware, StaticTokens, TokenFile, TokenSource, parse_token_list
from crm_mcp.tickets import TicketStore
from crm_mcp.tools import CrmTools, Variant

logger = logging.getLogger(__name__)

MCP_PATH = "/mcp"
HEALTH_PATH = "/healthz"
TICKETS_PATH = "/tickets"
CONTROL_VARIANT_PATH = "/_control/variant"
CONTROL_CALLS_PATH = "/_control/calls"
CONTROL_RESET_PATH = "/_control/reset"

_LOOPBACK_PEERS = frozenset({"127.0.0.1", "::1", "localhost"})

SERVER_INSTRUCTIONS = (
    "Demo CRM of an online coffee-equipment shop. Use get_customer to read a customer's record and recent "
    "orders, and create_ticket to open a support ticket for them."
)


def token_source(token: str | None = None, token_file: Path | None = None) -> TokenSource:
    """The file wins when both are given: it is the one an operator rotates."""
    if token_file is not None:
        return TokenFile(token_file)
    if token is not None:
        return StaticTokens(parse_token_list(token))
    raise ValueError("configure a bearer token (--token / CRM_MCP_TOKEN) or a token file (--token-file)")


def build_app(
    db_path: Path,
    *,
    token: str | None = None,
    token_file: Path | None = None,
    variant: Variant | str = Variant.STANDARD,
    enable_control: bool = False,
    bind_host: str = "127.0.0.1",
    read_latency_seconds: float = 0.0,
) -> ASGIApp:
    """The whole CRM as one ASGI app, for uvicorn or any in-process ASGI server.

    `token` may list several comma-separated tokens (old and new during a rotation); `token_file` is
    re-read whenever it changes. `bind_host` only decides whether MCP's DNS-rebinding protection
    (loopback Host headers only) is switched on.
    """
    tokens = token_source(token, token_file)
    store = TicketStore(db_path)
    server: MCPServer[object] = MCPServer(
        "abada-demo-crm", title="Demo CRM", instructions=SERVER_INSTRUCTIONS, version="0.1.0"
    )
    tools = CrmTools(server, store, Variant(variant), read_latency_seconds)

    @server.custom_route(HEALTH_PATH, methods=["GET"])
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @server.custom_route(TICKETS_PATH, methods=["GET"])
    async def list_tickets(request: Request) -> Response:
        tickets = await anyio.to_thread.run_sync(store.list_tickets)
        return JSONResponse([ticket.model_dump(mode="json") for ticket in tickets])

    if enable_control:

        @server.custom_route(CONTROL_CALLS_PATH, methods=["GET"])
        async def control_calls(request: Request) -> Response:
            peer = request.client.host if request.client else None
            if peer not in _LOOPBACK_PEERS:
                return JSONResponse(
                    {"error": "the control endpoint only answers loopback callers"}, status_code=403
                )
            return JSONResponse(tools.calls)

        @server.custom_route(CONTROL_RESET_PATH, methods=["POST"])
        async def control_reset(request: Request) -> Response:
            # One server serves test after test, each starting from an empty CRM: no start-up per test.
            peer = request.client.host if request.client else None
            if peer not in _LOOPBACK_PEERS:
                return JSONResponse(
                    {"error": "the control endpoint only answers loopback callers"}, status_code=403
                )
            try:
                body = json.loads(await request.body() or b"{}")
                latency_ms = body.get("read_latency_ms", 0)
                if not isinstance(latency_ms, int) or isinstance(latency_ms, bool) or latency_ms < 0:
                    raise ValueError(latency_ms)
            except (ValueError, AttributeError):
                return JSONResponse(
                    {"error": 'expected {"read_latency_ms": a whole number >= 0} or nothing'}, status_code=400
                )
            await anyio.to_thread.run_sync(store.clear)
            tools.reset(latency_ms / 1000)
            return JSONResponse({"variant": tools.variant.value, "read_latency_ms": latency_ms})

        @server.custom_route(CONTROL_VARIANT_PATH, methods=["GET", "POST"])
        async def control_variant(request: Request) -> Response:
            peer = request.client.host if request.client else None
            if peer not in _LOOPBACK_PEERS:
                return JSONResponse(
                    {"error": "the control endpoint only answers loopback callers"}, status_code=403
                )
            if request.method == "POST":
                try:
                    body = json.loads(await request.body())
                    requested = Variant(body["variant"])
                except (ValueError, KeyError, TypeError):
                    allowed = [member.value for member in Variant]
                    return JSONResponse(
                        {"error": f'expected {{"variant": one of {allowed}}}'},
                        status_code=400,
                    )
                tools.switch_variant(requested)
            return JSONResponse({"variant": tools.variant.value})

    mcp_app = server.streamable_http_app(streamable_http_path=MCP_PATH, host=bind_host)
    return BearerAuthMiddleware(mcp_app, tokens, public_paths=frozenset({HEALTH_PATH}))
