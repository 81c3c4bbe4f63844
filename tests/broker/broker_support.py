"""Running the credential broker as a real subprocess, and the bits every broker test needs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada.engine.v1 import external_task_pb2
from engine_helpers import deploy, fetch, start
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

CRM_CREDENTIAL = "crm-token"
CRM_SECRET_PATH = f"abada/tool-credentials/{CRM_CREDENTIAL}"
POOL = "agent-pool"
WORKER = f"{POOL}/pod-a"
BROKER_POLICY = {
    "secret/data/abada/tool-credentials/*": ["read"],
    "secret/metadata/abada/tool-credentials/*": ["read"],
}
_START_TIMEOUT_SECONDS = 60.0  # a Python service importing gRPC on a loaded 2-core machine
_STOP_TIMEOUT_SECONDS = 5.0
# Variables of the developer's shell that would change how the broker runs under test.
_INHERITED_PREFIXES = ("ABADA_", "VAULT_")


def secret_paths(credential: str) -> tuple[str, str]:
    """The two Vault paths a read of ``credential`` touches: its version metadata and its data."""
    return (
        f"/v1/secret/metadata/abada/tool-credentials/{credential}",
        f"/v1/secret/data/abada/tool-credentials/{credential}",
    )


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info
    raise AssertionError(f"no ErrorInfo on {error.code()}: {error.details()}")


def bundle(crm_url: str, *, bind: str = "crm/get_customer", extra_servers: str = "") -> str:
    """A deployment with the CRM tool server (and any ``extra_servers``), one agent node binding ``bind``."""
    return f"""
tool_servers:
  - name: crm
    transport: streamable-http
    url: {crm_url}
    credential: {CRM_CREDENTIAL}
    tools:
      get_customer: {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: key }}
{extra_servers}
processes:
  - id: triage
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Look the customer up.
        tools: [{bind}]
        result_variable: triage
        next: done
      - {{ id: done, type: end }}
"""


def extra_server(name: str, url: str, credential: str) -> str:
    """Another tool server entry; it must be a live MCP server offering get_customer (the engine checks)."""
    return f"""  - name: {name}
    transport: streamable-http
    url: {url}
    credential: {credential}
    tools:
      get_customer: {{ policy: read }}
"""


async def leased_task(
    engine: Any, content: str, *, worker_id: str = WORKER, lease_ms: int = 30_000
) -> external_task_pb2.ExternalTask:
    await deploy(engine, content)
    await start(engine, "triage", customerId="C-42")
    [task] = await fetch(engine, worker_id, "abada:agent", lease_ms=lease_ms)
    return task


@dataclass
class BrokerProcess:
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path
    channel: grpc.aio.Channel
    # The plaintext health-only port, when ABADA_BROKER_HEALTH_ADDRESS opened one.
    health_address: str | None = None
    # The HTTP/JSON port (base URL), when ABADA_BROKER_HTTP_ADDRESS opened one.
    http_url: str | None = None
    stub: credential_pb2_grpc.CredentialServiceStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = credential_pb2_grpc.CredentialServiceStub(self.channel)

    async def tool_credential(
        self, token: str | None, task_id: str, worker_id: str, lease_token: str, server: str = "crm"
    ) -> credential_pb2.GetToolCredentialResponse:
        request = credential_pb2.GetToolCredentialRequest(
            task_id=task_id, worker_id=worker_id, lease_token=lease_token, server=server
        )
        return await self.stub.GetToolCredential(request, metadata=bearer(token) if token else (), timeout=10)

    async def for_task(
        self,
        token: str,
        task: external_task_pb2.ExternalTask,
        *,
        worker_id: str = WORKER,
        server: str = "crm",
    ) -> credential_pb2.GetToolCredentialResponse:
        return await self.tool_credential(token, task.id, worker_id, task.lease_token, server)

    async def deploy_credential(
        self,
        token: str | None,
        credential: str = CRM_CREDENTIAL,
        server: str = "crm",
        url: str = "http://127.0.0.1:8931/mcp",
        on_behalf_of: str = "ops",
    ) -> credential_pb2.GetDeployCredentialResponse:
        request = credential_pb2.GetDeployCredentialRequest(
            credential=credential, server=server, url=url, on_behalf_of=on_behalf_of
        )
        return await self.stub.GetDeployCredential(
            request, metadata=bearer(token) if token else (), timeout=10
        )

    async def health(self, service: str = "") -> int:
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status

    async def wait_for_health(self, status: int, service: str = "", timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                last = await self.health(service)
                if last == status:
                    return
            except grpc.aio.AioRpcError as error:
                last = error.code()
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"broker health for {service!r} stayed {last}, wanted {status}\n{self.log_tail()}"
        )

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def log_lines(self) -> list[dict[str, Any]]:
        """Every line the broker wrote, parsed: each must be one JSON object."""
        return [json.loads(line) for line in self.log_text().splitlines() if line.strip()]

    def audit_events(self) -> list[dict[str, Any]]:
        return [line for line in self.log_lines() if line.get("logger") == "abada_broker.audit"]

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def broker_environment(settings: Mapping[str, str]) -> dict[str, str]:
    inherited = {
        name: value for name, value in os.environ.items() if not name.startswith(_INHERITED_PREFIXES)
    }
    return {**inherited, "PYTHONUNBUFFERED": "1", **settings}


def _spawn(
    scratch: Path, settings: Mapping[str, str], arguments: Sequence[str]
) -> tuple[subprocess.Popen[bytes], Path]:
    scratch.mkdir(parents=True, exist_ok=True)
    ready_file = scratch / "ready.json"
    ready_file.unlink(missing_ok=True)
    environment = broker_environment(
        {"ABADA_BROKER_GRPC_ADDRESS": "127.0.0.1:0", "ABADA_BROKER_READY_FILE": str(ready_file), **settings}
    )
    with open(scratch / "broker.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "abada_broker", *arguments],
            stdout=log,
            stderr=log,
            env=environment,
            cwd=scratch,
        )
    return process, ready_file


@contextlib.asynccontextmanager
async def running_broker(
    scratch: Path,
    settings: Mapping[str, str],
    *,
    arguments: Sequence[str] = (),
    wait_serving: bool = True,
    channel_credentials: grpc.ChannelCredentials | None = None,
) -> AsyncIterator[BrokerProcess]:
    """``python -m abada_broker ARGUMENTS`` with ``settings`` as its environment, its output into
    ``scratch/broker.log``; stopped with SIGTERM (then SIGKILL) on exit. ``channel_credentials`` dial a
    broker that listens with TLS."""
    process, ready_file = _spawn(scratch, settings, arguments)
    log_path = scratch / "broker.log"
    try:
        deadline = time.monotonic() + _START_TIMEOUT_SECONDS
        while not ready_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the broker exited with {process.returncode}:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the broker did not start in time:\n{log_path.read_text()}")
            await asyncio.sleep(0.05)
        ready = json.loads(ready_file.read_text())
        address = ready["address"]
        channel = (
            grpc.aio.insecure_channel(address)
            if channel_credentials is None
            else grpc.aio.secure_channel(address, channel_credentials)
        )
        async with channel:
            broker = BrokerProcess(
                process=process,
                address=address,
                log_path=log_path,
                channel=channel,
                health_address=ready.get("health_address"),
                http_url=f"http://{ready['http_address']}" if "http_address" in ready else None,
            )
            if wait_serving:
                await broker.wait_for_health(health_pb2.HealthCheckResponse.SERVING)
            yield broker
    finally:
        await stop_process(process)


async def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, wait without blocking the test loop, SIGKILL if it does not go in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    poll_seconds = 0.02
    for _ in range(int(_STOP_TIMEOUT_SECONDS / poll_seconds)):
        if process.poll() is not None:
            return
        await asyncio.sleep(poll_seconds)
    process.kill()
    process.wait()


def write_atomically(path: Path, content: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(content)
    os.replace(temporary, path)
