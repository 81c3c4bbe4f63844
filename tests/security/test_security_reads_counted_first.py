"""Finding 6: a read past `max_tool_calls` still ran.

A single read was called first and journaled after, finished: the engine counted it against the
node's limits only once the server had already been asked. With `max_tool_calls: 1` the server
received both lookups, and the incident came after. A read is now journaled STARTED first.
"""

from __future__ import annotations

import logging
import uuid
from typing import cast

import grpc
import pytest
from abada_sdk.connection import BearerToken
from abada_worker.broker_client import BrokerClient
from abada_worker.conversation import FunctionCall
from abada_worker.engine_client import EngineClient, LeaseRef
from abada_worker.errors import LimitExceeded
from abada_worker.interruption import TaskInterruption
from abada_worker.journal import Journal
from abada_worker.logs import TaskLog
from abada_worker.replay import PlannedCall
from abada_worker.tool_batch import ToolBatch
from abada_worker.toolbox import Toolbox
from abada_worker.work import AgentWork, Limits, ToolBinding
from engine_helpers import deploy, fetch, journal, start
from hostile_mcp import hostile_mcp_server

ONE_READ = """
tool_servers:
  - name: lookups
    transport: streamable-http
    url: {url}
    tools:
      lookup: {{ policy: read }}
processes:
  - id: reads
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: p
        tools: [lookups/lookup]
        limits: {{ max_model_calls: 5, max_tool_calls: 1 }}
        result_variable: r
        next: done
      - {{ id: done, type: end }}
"""


def _lookup() -> PlannedCall:
    return PlannedCall(FunctionCall(str(uuid.uuid4()), "lookups__lookup", {"q": "x"}))


async def test_a_read_past_the_limit_never_reaches_the_server(engine, engine_tokens):
    async with hostile_mcp_server("fine") as server:
        await deploy(engine, ONE_READ.format(url=server.url))
        await start(engine, "reads")
        [task] = await fetch(engine, "w", "abada:agent")
        binding = ToolBinding("lookups", "lookup", False, False, server.url, "streamable-http", "", "")
        work = AgentWork(
            "abada.agent/v1", "gemini-m", "gemini", "p", (binding,), Limits(5, 1, 0), None, "r", None
        )
        lease = LeaseRef(task.id, task.lease_token, task.attempt)
        async with grpc.aio.insecure_channel(engine.address) as channel:
            client = EngineClient(channel, "w", BearerToken(engine_tokens.suite))
            steps = Journal(client, lease, next_sequence=1)
            async with Toolbox.open(work, lease, cast(BrokerClient, None), timeout_seconds=10) as toolbox:
                batch = ToolBatch(
                    toolbox, steps, TaskInterruption(), TaskLog(logging.getLogger("test"), {}), concurrency=1
                )
                await batch.run((_lookup(),))
                calls_after_first = server.calls
                with pytest.raises(LimitExceeded):
                    await batch.run((_lookup(),))
        assert calls_after_first == 1
        assert server.calls == 1  # the second lookup was refused before it was sent
        assert len(await journal(engine, task.id)) == 1
