"""The bound tools of one attempt: credentials, one MCP session per server, the contract, dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from .broker_client import BrokerClient, Secret
from .conversation import FunctionSpec
from .dependencies import DependencyDown, tool_server
from .engine_client import LeaseRef
from .errors import AttemptFailed
from .fault import FaultPlan
from .gen_ai_spans import gen_ai_span
from .metrics import TOOL_CALL_SECONDS
from .prompt import function_name
from .step_payloads import error_result
from .tool_session import ContractMismatch, ToolServer, check_contract, unsupported_transports
from .work import AgentWork, ToolBinding

CONTRACT_MISMATCH = "TOOL_CONTRACT_MISMATCH"
MAX_RESULT_BYTES = 512_000


class ContractBroken(AttemptFailed):
    def __init__(self, mismatches: Sequence[ContractMismatch]) -> None:
        described = "; ".join(f"{m.server}/{m.tool}: {m.problem}" for m in mismatches)
        super().__init__(
            CONTRACT_MISMATCH,
            f"the tool servers no longer offer what this definition version was deployed against: {described}",
            no_retry=True,
            details={"mismatches": [m.as_dict() for m in mismatches]},
        )


@dataclass(frozen=True)
class BoundTool:
    binding: ToolBinding
    spec: FunctionSpec


class Toolbox:
    def __init__(
        self, servers: dict[str, ToolServer], tools: dict[str, BoundTool], timeout_seconds: float
    ) -> None:
        self._servers = servers
        self._tools = tools
        self._timeout = timeout_seconds

    @property
    def functions(self) -> tuple[FunctionSpec, ...]:
        return tuple(tool.spec for tool in self._tools.values())

    def binding_for(self, function: str) -> ToolBinding | None:
        tool = self._tools.get(function)
        return tool.binding if tool is not None else None

    async def call(
        self, binding: ToolBinding, arguments: dict[str, Any], idempotency_key: str | None
    ) -> dict[str, Any]:
        with gen_ai_span(
            "execute_tool",
            binding.tool,
            {
                "gen_ai.tool.name": binding.tool,
                "abada.tool.ref": f"{binding.server}/{binding.tool}",
                "abada.tool.keyed": idempotency_key is not None,
            },
        ) as span:
            began = time.monotonic()
            outcome = "failed"
            try:
                result = await self._servers[binding.server].call(
                    binding.tool, arguments, idempotency_key, self._timeout
                )
                outcome = "tool_error" if result.get("isError") else "ok"
            finally:
                TOOL_CALL_SECONDS.labels(f"{binding.server}/{binding.tool}", outcome).observe(
                    time.monotonic() - began
                )
            if outcome == "tool_error":
                span.set_attribute("error.type", "tool_error")
        size = len(json.dumps(result, ensure_ascii=False).encode())
        if size > MAX_RESULT_BYTES:
            # The journal refuses payloads this big, and no model makes good use of them either.
            return error_result(
                f"{binding.tool} was called, but its result was {size} bytes, more than the "
                f"{MAX_RESULT_BYTES} this worker passes on; it is not shown."
            )
        return result

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        work: AgentWork,
        lease: LeaseRef,
        broker: BrokerClient,
        *,
        timeout_seconds: float,
        fault: FaultPlan | None = None,
    ) -> AsyncIterator[Toolbox]:
        """Connects to every bound server and checks its contract; a broken one ends the attempt, no retry."""
        unsupported = unsupported_transports(work.bindings)
        if unsupported:
            first = unsupported[0]
            raise AttemptFailed(
                "UNSUPPORTED_TRANSPORT",
                f"tool server {first.server!r} uses transport {first.transport!r}; this worker speaks streamable-http",
                no_retry=True,
            )
        servers: dict[str, ToolServer] = {}
        tools: dict[str, BoundTool] = {}
        mismatches: list[ContractMismatch] = []
        secrets: list[Secret] = []
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(lambda: [BrokerClient.forget(secret) for secret in secrets])
            for server, bindings in work.servers().items():
                credential = None
                if bindings[0].credential:
                    credential = await broker.tool_credential(lease, server)
                    secrets.append(credential)
                # One deadline for the whole opening (connect, initialize, every page of the tool
                # list): a server that answers a byte at a time never trips a read timeout.
                try:
                    async with asyncio.timeout(timeout_seconds):
                        session = await stack.enter_async_context(
                            ToolServer.connect(
                                server,
                                bindings[0].url,
                                credential,
                                timeout_seconds=timeout_seconds,
                                fault=fault,
                            )
                        )
                        listed = await session.list_tools()
                except TimeoutError:
                    raise DependencyDown(
                        tool_server(server),
                        f"tool server {server!r} at {bindings[0].url} did not open a session and list its "
                        f"tools within {timeout_seconds:g} s",
                    ) from None
                servers[server] = session
                mismatches += check_contract(bindings, listed)
                for binding in bindings:
                    tool = listed.get(binding.tool)
                    if tool is not None:
                        name = function_name(binding)
                        spec = FunctionSpec(name, tool.description or "", tool.input_schema)
                        tools[name] = BoundTool(binding, spec)
            if mismatches:
                raise ContractBroken(mismatches)
            yield cls(servers, tools, timeout_seconds)
