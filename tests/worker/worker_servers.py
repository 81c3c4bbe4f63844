"""Test servers the worker talks to: credential brokers (a fake in-process one, the real one as a
subprocess) and a header-echoing MCP server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvicorn
import yaml
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada_broker.auth import callers_document
from mcp.server.mcpserver import Context, MCPServer


@dataclass
class FakeBroker(credential_pb2_grpc.CredentialServiceServicer):
    """Hands out the configured secret per server and remembers who asked, with which lease."""

    secrets: dict[str, str]
    requests: list[credential_pb2.GetToolCredentialRequest] = field(default_factory=list)
    authorizations: list[str] = field(default_factory=list)

    async def GetToolCredential(
        self, request: credential_pb2.GetToolCredentialRequest, context: grpc.aio.ServicerContext
    ) -> credential_pb2.GetToolCredentialResponse:
        self.requests.append(request)
        self.authorizations.append(dict(context.invocation_metadata() or ()).get("authorization", ""))
        if request.server not in self.secrets:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"no credential for {request.server}")
        return credential_pb2.GetToolCredentialResponse(
            secret=self.secrets[request.server], credential="crm-token"
        )


@asynccontextmanager
async def running_broker(secrets: dict[str, str]) -> AsyncIterator[tuple[FakeBroker, str]]:
    broker = FakeBroker(secrets)
    server = grpc.aio.server()
    credential_pb2_grpc.add_CredentialServiceServicer_to_server(broker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield broker, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def _echo_server() -> MCPServer[Any]:
    server: MCPServer[Any] = MCPServer("echo")

    async def echo_keys(note: str, ctx: Context) -> dict[str, Any]:
        headers = {name.lower(): value for name, value in (ctx.headers or {}).items()}
        meta = ctx.request_context.meta
        meta_key = meta.get("idempotencyKey") if meta is not None else None
        return {"header": headers.get("idempotency-key"), "meta": meta_key, "note": note}

    server.add_tool(echo_keys, name="echo_keys", description="Echoes the idempotency key it received.")
    return server


@asynccontextmanager
async def running_echo_mcp() -> AsyncIterator[str]:
    """An MCP server on the test's own loop whose tool reports the idempotency key it was sent."""
    app = _echo_server().streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "uvicorn stopped before it started"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        await serving


@dataclass(frozen=True)
class RealBroker:
    address: str
    log_path: Path

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        parsed = []
        for line in self.log_text().splitlines():
            if line.startswith("{"):
                parsed.append(json.loads(line))
        return parsed


@asynccontextmanager
async def running_real_broker(
    scratch: Path,
    *,
    engine_address: str,
    engine_token: str,
    worker_identity: str,
    worker_token: str,
    secrets: dict[str, str],
) -> AsyncIterator[RealBroker]:
    """The credential broker as a subprocess: file secret backend, the worker's token accepted, lease checks
    against the real engine. Stopped with SIGTERM (then SIGKILL) on exit."""
    callers = scratch / "broker-callers.yaml"
    callers.write_text(yaml.safe_dump(callers_document([(worker_identity, ["worker"], worker_token)])))
    secrets_file = scratch / "secrets.yaml"
    secrets_file.write_text(yaml.safe_dump(secrets))
    ready_file = scratch / "broker-ready.json"
    log_path = scratch / "broker.log"
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith(("ABADA_", "VAULT_"))
    }
    environment |= {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_token,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(callers),
        "ABADA_SECRET_BACKEND": "file",
        "ABADA_SECRETS_FILE": str(secrets_file),
        "ABADA_BROKER_GRPC_ADDRESS": "127.0.0.1:0",
        "ABADA_BROKER_READY_FILE": str(ready_file),
    }
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "abada_broker", "serve", stdout=log, stderr=log, env=environment
        )
    try:
        deadline = time.monotonic() + 60  # its imports alone take many seconds on a loaded machine
        while not ready_file.exists():
            if process.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start:\n{log_path.read_text(errors='replace')}")
            await asyncio.sleep(0.05)
        yield RealBroker(json.loads(ready_file.read_text())["address"], log_path)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 5)
            except TimeoutError:
                process.kill()
                await process.wait()
