"""Shared fixtures: a real PostgreSQL, a real engine over a real gRPC socket, generated clients.

PostgreSQL is the one in ABADA_TEST_DATABASE_URL when set (a fresh database is
created in it for the session and dropped after), else an embedded pgserver.
"""

from __future__ import annotations

import base64
import os
import pathlib
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import asyncpg
import grpc
import pytest
import yaml
from abada.engine.v1 import (
    approval_pb2_grpc,
    definition_pb2_grpc,
    external_task_pb2_grpc,
    incident_pb2_grpc,
    process_pb2_grpc,
)
from abada_engine.api.guard import Guard
from abada_engine.api.server import RunningServer, start_grpc_server
from abada_engine.auth import CallerRegistry, token_sha256
from abada_engine.core import EngineCore
from abada_engine.db.database import create_engine
from abada_engine.db.migrate import migrate
from abada_engine.definitions.tool_contracts import FileCredentials, McpContractCheck
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from bearer import BearerToken
from crm_mcp.testing import RunningCrmServer, running_crm_server
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Output in the tests goes to pipes and is read as such: a terminal size from the runner (pytest-xdist's
# workers set COLUMNS=80) would fit the CLI's tables to it in some processes and not in others.
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)
# Two keys, so every test exercises a ring where the primary is not the only key.
UNKEYED_WRITE_GRACE_SECONDS = 5.0
TEST_JOURNAL_KEYS = KeyRing.parse(
    "k2:" + base64.b64encode(b"\x02" * 32).decode() + ",k1:" + base64.b64encode(b"\x01" * 32).decode()
)


def _with_database(url: str, name: str) -> str:
    base, _, query = url.partition("?")
    head = base.rsplit("/", 1)[0]
    return f"{head}/{name}" + (f"?{query}" if query else "")


@pytest.fixture(scope="session")
def database_url() -> Iterator[str]:
    admin_url = os.environ.get("ABADA_TEST_DATABASE_URL")
    if not admin_url:
        import pgserver

        with tempfile.TemporaryDirectory(prefix="abada-pg-") as data_dir:
            server = pgserver.get_server(data_dir, cleanup_mode="stop")
            yield server.get_uri()
            server.cleanup()
        return
    import asyncio

    name = f"abada_test_{os.getpid()}_{secrets.token_hex(3)}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(admin_url, name)
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
async def db(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(database_url, pool_size=20)
    await migrate(engine)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
def deploy_credentials(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The file the engine reads tool-server credentials from at deploy time (name: value).

    A test that deploys a bundle with tool servers writes their credentials here first.
    """
    path = tmp_path_factory.mktemp("deploy") / "credentials.yaml"
    path.write_text("{}\n")
    return path


@pytest.fixture(scope="module")
def crm() -> Iterator[RunningCrmServer]:
    """The demo CRM MCP server, one a test module (its tickets start empty in each), with its control
    endpoint so a test can switch its tool set (`set_variant`) or break it."""
    with running_crm_server(enable_control=True) as server:
        yield server


@pytest.fixture
def crm_credentials(crm: RunningCrmServer, deploy_credentials: pathlib.Path) -> Iterator[RunningCrmServer]:
    """The CRM with its token in the engine's deploy credentials, and its standard tool set."""
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    crm.set_variant("standard")
    yield crm
    crm.set_variant("standard")


@pytest.fixture(scope="session")
async def engine_core(
    db: AsyncEngine, database_url: str, deploy_credentials: pathlib.Path
) -> AsyncIterator[EngineCore]:
    core = await EngineCore.open(
        db,
        database_url,
        TEST_JOURNAL_KEYS,
        IdempotencyKeys(b"test-idempotency-secret"),
        McpContractCheck(FileCredentials(deploy_credentials), timeout_seconds=5),
        # The reaper leaves an expired unkeyed write to its holder this long (30 s in production):
        # long beside a test's pauses, short enough for the test that waits it out.
        unkeyed_write_grace_seconds=UNKEYED_WRITE_GRACE_SECONDS,
        # The session's engine starts once, with the first test that needs it: taking over expired
        # leases at once keeps that test's timings those of every other. The grace after a start or
        # a database outage is tested on its own (test_engine_leases.py) and by the fault suite's
        # engine processes, which run with the default.
        takeover_grace_seconds=0.0,
    )
    yield core
    await core.close()


@dataclass(frozen=True)
class EngineTokens:
    """Bearer tokens the test engine knows, by caller.

    `suite` may do everything and act as any worker id (the shared `engine` clients use it);
    the others are what production callers look like.
    """

    suite: str
    operator: str
    broker: str
    worker_pool: str  # identity "agent-pool": worker ids "agent-pool/...", topic abada:agent only
    callers_file: pathlib.Path
    approver: str = ""  # identity "carol": role approver only
    publisher: str = ""  # identity "helpdesk": role publisher, message customer_reply only


@pytest.fixture(scope="session")
def engine_tokens(tmp_path_factory: pytest.TempPathFactory) -> EngineTokens:
    tokens = {
        name: secrets.token_urlsafe(24)
        for name in ("suite", "operator", "broker", "pool", "approver", "publisher")
    }
    callers = [
        {
            "identity": "test-suite",
            "roles": ["operator", "worker", "broker"],
            "topics": ["*"],
            "act_as_any_worker": True,
            "token_sha256": token_sha256(tokens["suite"]),
        },
        {"identity": "ops", "roles": ["operator"], "token_sha256": token_sha256(tokens["operator"])},
        {"identity": "carol", "roles": ["approver"], "token_sha256": token_sha256(tokens["approver"])},
        {
            "identity": "helpdesk",
            "roles": ["publisher"],
            "messages": ["customer_reply"],
            "token_sha256": token_sha256(tokens["publisher"]),
        },
        {"identity": "abada-broker", "roles": ["broker"], "token_sha256": token_sha256(tokens["broker"])},
        {
            "identity": "agent-pool",
            "roles": ["worker"],
            "topics": ["abada:agent"],
            "token_sha256": token_sha256(tokens["pool"]),
        },
    ]
    path = tmp_path_factory.mktemp("auth") / "callers.yaml"
    path.write_text(yaml.safe_dump({"callers": callers}))
    return EngineTokens(
        tokens["suite"],
        tokens["operator"],
        tokens["broker"],
        tokens["pool"],
        path,
        tokens["approver"],
        tokens["publisher"],
    )


@pytest.fixture(scope="session")
async def engine_server(engine_core: EngineCore, engine_tokens: EngineTokens) -> AsyncIterator[RunningServer]:
    guard = Guard(CallerRegistry(engine_tokens.callers_file))
    running = await start_grpc_server(engine_core, "127.0.0.1:0", guard)
    yield running
    await running.stop(0)


@dataclass
class EngineClients:
    channel: grpc.aio.Channel
    address: str
    definitions: definition_pb2_grpc.DefinitionServiceStub
    processes: process_pb2_grpc.ProcessServiceStub
    tasks: external_task_pb2_grpc.ExternalTaskServiceStub
    incidents: incident_pb2_grpc.IncidentServiceStub
    approvals: approval_pb2_grpc.ApprovalServiceStub


@pytest.fixture(scope="session")
async def engine_channel(
    engine_server: RunningServer, engine_tokens: EngineTokens
) -> AsyncIterator[tuple[grpc.aio.Channel, str]]:
    address = f"127.0.0.1:{engine_server.port}"
    async with grpc.aio.insecure_channel(address, interceptors=[BearerToken(engine_tokens.suite)]) as channel:
        yield channel, address


async def empty_tables(db: AsyncEngine) -> None:
    # The engine keeps running between tests (its reaper too): lock the tables in the order its own
    # transactions take them (tasks before the journal), and try again if a deadlock still happens.
    # A session left in an open transaction would make TRUNCATE wait for ever: wait a bounded time
    # and name the sessions in the way instead.
    for attempt in range(5):
        try:
            async with db.begin() as conn:
                await conn.execute(text("SET LOCAL lock_timeout = '60s'"))
                await conn.execute(
                    text(
                        "TRUNCATE batch_items, batches, approvals, tasks, instances, definitions, journal_steps, incidents, history, model_quota_usage, "
                        "model_quota_calls, model_quota_waiters, dependencies, timers, messages, start_requests, erasures "
                        "RESTART IDENTITY CASCADE"
                    )
                )
                # The circuits are gone: every replica's view of them is read again (as after any change).
                await conn.execute(text("SELECT pg_notify('abada_dependencies', '')"))
            return
        except DBAPIError as error:
            if "lock timeout" in str(error):
                raise AssertionError(
                    f"emptying the tables waited 60 s on: {await _open_transactions(db)}"
                ) from error
            if "deadlock" not in str(error) or attempt == 4:
                raise


async def _open_transactions(db: AsyncEngine) -> list[dict[str, object]]:
    """The other sessions on the test database that hold a transaction open, and what they last ran."""
    async with db.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT pid, application_name, state, xact_start, left(query, 300) AS query FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND xact_start IS NOT NULL"
            )
        )
        return [dict(row._mapping) for row in rows]


@pytest.fixture
async def engine(
    engine_channel: tuple[grpc.aio.Channel, str], db: AsyncEngine
) -> AsyncIterator[EngineClients]:
    """Generated clients on a clean database (every table emptied before the test)."""
    await empty_tables(db)
    channel, address = engine_channel
    yield EngineClients(
        channel=channel,
        address=address,
        definitions=definition_pb2_grpc.DefinitionServiceStub(channel),
        processes=process_pb2_grpc.ProcessServiceStub(channel),
        tasks=external_task_pb2_grpc.ExternalTaskServiceStub(channel),
        incidents=incident_pb2_grpc.IncidentServiceStub(channel),
        approvals=approval_pb2_grpc.ApprovalServiceStub(channel),
    )


@pytest.fixture(scope="session")
async def engine_http(
    engine_server: RunningServer, engine_core: EngineCore, engine_tokens: EngineTokens
) -> AsyncIterator[str]:
    """The engine's HTTP side over the session's engine: every RPC as HTTP/JSON; its base URL."""
    from abada_engine.api.http import HttpServer, build_app
    from abada_engine.runtime.queue_stats import QueueStats

    app = build_app(
        QueueStats(engine_core.db),
        CallerRegistry(engine_tokens.callers_file),
        database=engine_core.database,
        servicers=engine_server.servicers,
    )
    server = HttpServer(app, "127.0.0.1:0")
    await server.start()
    yield f"http://127.0.0.1:{server.port}"
    await server.stop()
