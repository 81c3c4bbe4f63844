"""The fault drills' parts: a scratch database on the suite's PostgreSQL, and a running stack per drill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import asyncpg
import pytest
import yaml
from crm_mcp.testing import RunningCrmServer, running_crm_server
from fault_stack import (
    Engine,
    ServiceProcess,
    alice_bundle,
    alice_script,
    broker_service,
    deploy,
    engine_service,
    wait_for,
    worker_service,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_gemini.testing import load_script, reset_calls, running_scripted_gemini

# Modest sizes: the drills in the issue ran 100 instances; bench/fault_drill.py runs those.
INSTANCES = 12
WORKERS = 2
CONCURRENCY = 4
LEASE_MS = 6_000


@pytest.fixture(scope="module")
def crm() -> Iterator[RunningCrmServer]:
    with running_crm_server(enable_control=True) as server:
        yield server


@pytest.fixture(scope="module")
def gemini_url() -> Iterator[str]:
    with running_scripted_gemini(alice_script()) as url:
        yield url


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    name = f"abada_fault_{os.getpid()}_{secrets.token_hex(3)}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    base, _, query = admin_url.partition("?")
    try:
        yield base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def shared_database() -> Iterator[str]:
    """A fresh database on the suite's PostgreSQL (or an embedded one): for drills that leave it running."""
    admin_url = os.environ.get("ABADA_TEST_DATABASE_URL")
    if admin_url:
        with scratch_database(admin_url) as url:
            yield url
        return
    import pgserver

    with tempfile.TemporaryDirectory(prefix="abada-fault-pg-") as data_dir:
        server = pgserver.get_server(data_dir, cleanup_mode="stop")
        yield server.get_uri()
        server.cleanup()


@dataclass
class Stack:
    engine: Engine
    broker: ServiceProcess
    broker_address: str
    crm: RunningCrmServer
    gemini_url: str
    state: pathlib.Path
    workers: list[ServiceProcess] = field(default_factory=list)

    def add_worker(
        self,
        name: str,
        *,
        engine_address: str | None = None,
        extra: dict[str, str] | None = None,
        concurrency: int = CONCURRENCY,
        lease_ms: int = LEASE_MS,
    ) -> ServiceProcess:
        worker = worker_service(
            self.state,
            name,
            engine_address=engine_address or self.engine.address,
            token=self.engine.token,
            broker_address=self.broker_address,
            gemini_url=self.gemini_url,
            lease_ms=lease_ms,
            concurrency=concurrency,
            extra=extra,
        )
        worker.start()
        self.workers.append(worker)
        return worker

    def logs(self) -> str:
        parts = [f"--- {self.engine.service.name}\n{self.engine.service.tail()}"]
        parts += [f"--- {w.name}\n{w.tail(30)}" for w in self.workers]
        return "\n".join(parts)


def _broker_serving(address: str) -> bool:
    import grpc

    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


@contextlib.asynccontextmanager
async def running_stack(
    state: pathlib.Path, database_url: str, crm: RunningCrmServer, gemini_url: str, idempotency: str = "key"
) -> AsyncIterator[Stack]:
    """Engine and broker up, Alice's bundle deployed, the script loaded and its ledger empty; no workers."""
    credentials = state / "deploy-credentials.yaml"
    credentials.write_text(yaml.safe_dump({"crm-token": crm.token}))
    engine = engine_service(state, database_url, credentials)
    broker, broker_address = broker_service(state, engine, crm.token)
    stack = Stack(engine, broker, broker_address, crm, gemini_url, state)
    try:
        await engine.start()
        broker.start()
        await wait_for(lambda: _broker_serving(broker_address), "the broker serving", 60)
        async with engine.channel() as channel:
            await deploy(channel, alice_bundle(crm.url, idempotency))
        load_script(gemini_url, alice_script())
        reset_calls(gemini_url)
        yield stack
    finally:
        for worker in stack.workers:
            worker.kill()
        broker.stop()
        engine.service.stop()
