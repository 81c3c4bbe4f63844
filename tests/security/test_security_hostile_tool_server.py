"""Finding 3: a hostile MCP server could hang or exhaust the agent worker (and the engine at deploy).

Endless `tools/list` pagination grew the worker to 1.2 GB with the task renewed for ever; an answer
trickling a space every 5 s held a task past every read timeout; a 300 MB `tools/call` answer was
read whole before its size was checked. Now: caps on pages and tools, one deadline for opening a
session, and every response body counted as it streams in.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import grpc
import pytest
from abada_common.tool_limits import MAX_RESPONSE_BYTES, MAX_TOOL_LIST_PAGES
from abada_worker.broker_client import BrokerClient
from abada_worker.dependencies import DependencyDown
from abada_worker.engine_client import LeaseRef
from abada_worker.tool_session import ToolServer, ToolServerRefused
from abada_worker.toolbox import Toolbox
from abada_worker.work import AgentWork, Limits, ToolBinding
from engine_helpers import deploy, error_info
from hostile_mcp import hostile_mcp_server

LEASE = LeaseRef(task_id="task-1", lease_token="token-1", attempt=1)


def _work(url: str) -> AgentWork:
    binding = ToolBinding("hostile", "lookup", False, False, url, "streamable-http", "", "")
    return AgentWork(
        "abada.agent/v1", "gemini-m", "gemini", "p", (binding,), Limits(4, 4, 1000), None, "r", None
    )


async def _listed(url: str) -> Any:
    async with ToolServer.connect("hostile", url, None, timeout_seconds=10) as server:
        return await server.list_tools()


async def test_endless_pagination_is_refused_at_the_page_cap():
    async with hostile_mcp_server("endless_pages") as server:
        with pytest.raises(ToolServerRefused) as refused:
            await asyncio.wait_for(_listed(server.url), 60)
    assert f"past {MAX_TOOL_LIST_PAGES} pages" in refused.value.message
    assert server.pages == MAX_TOOL_LIST_PAGES


async def test_a_list_of_thousands_of_tools_is_refused():
    async with hostile_mcp_server("many_tools") as server:
        with pytest.raises(ToolServerRefused) as refused:
            await asyncio.wait_for(_listed(server.url), 60)
    assert "more than" in refused.value.message


async def test_a_trickling_answer_misses_the_session_deadline_and_counts_as_an_outage():
    async with hostile_mcp_server("trickle") as server:
        with pytest.raises(DependencyDown) as down:
            async with asyncio.timeout(60):
                async with Toolbox.open(
                    _work(server.url), LEASE, cast(BrokerClient, None), timeout_seconds=3
                ):
                    pass
    assert "within 3 s" in str(down.value)
    assert server.pages == 1


async def test_a_huge_answer_is_cut_off_while_it_streams():
    huge = 10 * MAX_RESPONSE_BYTES
    async with hostile_mcp_server("huge_call", huge_bytes=huge) as server:
        with pytest.raises(ToolServerRefused) as refused:
            async with ToolServer.connect("hostile", server.url, None, timeout_seconds=10) as session:
                await session.call("lookup", {}, None, 30)
        await asyncio.wait_for(server.stopped_listening.wait(), 30)
    assert f"more than {MAX_RESPONSE_BYTES} bytes" in refused.value.message
    # The worker stopped reading: the server could not hand over the rest (socket buffers aside).
    assert server.sent_bytes < huge / 2


DEPLOYED = """
tool_servers:
  - name: hostile
    transport: streamable-http
    url: {url}
    tools:
      lookup: {{ policy: read }}
processes:
  - id: uses_hostile
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: p
        tools: [hostile/lookup]
        result_variable: r
        next: done
      - {{ id: done, type: end }}
"""


async def test_the_engine_refuses_endless_pagination_at_deploy(engine):
    async with hostile_mcp_server("endless_pages") as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await deploy(engine, DEPLOYED.format(url=server.url))
    assert error_info(caught.value).reason == "TOOL_SERVER_OVER_LIMIT"
    assert server.pages == MAX_TOOL_LIST_PAGES


async def test_the_engine_stops_reading_a_huge_tool_list_at_deploy_at_the_limit(engine):
    async with hostile_mcp_server("huge_list", huge_bytes=200 * 1024 * 1024) as server:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await deploy(engine, DEPLOYED.format(url=server.url))
        sent = server.sent_bytes
    assert error_info(caught.value).reason == "TOOL_SERVER_OVER_LIMIT"
    assert "larger than" in caught.value.details()
    # The engine stopped listening near the limit, not after the server's 200 MB.
    assert sent < MAX_RESPONSE_BYTES + 4 * 1024 * 1024


async def test_the_engine_sends_deploy_credentials_through_no_proxy_from_its_environment(engine, monkeypatch):
    """A proxy named in the engine's environment (as a compromised or careless host may set) would see
    every deploy-time request to a tool server, credentials included."""
    proxied: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        proxied.append(await reader.readline())
        writer.close()

    listening = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{port}")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    try:
        async with hostile_mcp_server("fine") as server:
            deployed = await deploy(engine, DEPLOYED.format(url=server.url))
    finally:
        listening.close()
    assert deployed.definitions
    assert proxied == []
