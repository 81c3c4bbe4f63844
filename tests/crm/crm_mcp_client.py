"""A real MCP client for the CRM tests: streamable-http over httpx2, bearer auth, per-call Idempotency-Key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Generator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import httpx2
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CallToolResult

# ClientSession.call_tool has no per-call headers; the transport sends each request in the caller's
# context, so a request hook can read the key the caller set just before the call.
_idempotency_header_key: ContextVar[str | None] = ContextVar("crm_test_idempotency_header_key", default=None)


class BearerAuth(httpx2.Auth):
    def __init__(self, token: str) -> None:
        self._token = token

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._token}"
        yield request


async def _add_idempotency_header(request: httpx2.Request) -> None:
    key = _idempotency_header_key.get()
    if key is not None:
        request.headers["Idempotency-Key"] = key


@asynccontextmanager
async def crm_session(url: str, token: str) -> AsyncIterator[ClientSession]:
    async with httpx2.AsyncClient(
        auth=BearerAuth(token), event_hooks={"request": [_add_idempotency_header]}, timeout=10.0
    ) as http:
        async with streamable_http_client(url, http_client=http) as (read_stream, write_stream):
            async with ClientSession(read_stream, write_stream) as session:
                await session.initialize()
                yield session


async def call_tool(
    session: ClientSession,
    name: str,
    arguments: dict[str, Any],
    *,
    header_key: str | None = None,
    meta_key: str | None = None,
) -> CallToolResult:
    reset_token = _idempotency_header_key.set(header_key)
    try:
        meta = None if meta_key is None else {"idempotencyKey": meta_key}
        return await session.call_tool(name, arguments, meta=meta)
    finally:
        _idempotency_header_key.reset(reset_token)


def result_json(result: CallToolResult) -> Any:
    assert not result.is_error, f"unexpected tool error: {result_text(result)}"
    return json.loads(result_text(result))


def result_text(result: CallToolResult) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)
