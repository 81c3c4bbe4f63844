"""The whole of Abada as real processes, for drills that kill and restart parts of it.

An engine (restartable on the same ports), the credential broker (file backend), the demo CRM MCP
server, the scripted Gemini endpoint and agent workers, each a subprocess logging to a file; the
test drives instances through generated gRPC clients and reads the outcome from three ledgers: the
engine (where each instance went), the CRM (tickets and their idempotency keys) and the scripted
endpoint (every model turn it played, so a turn paid twice shows).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import yaml
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from crm_mcp.testing import RunningCrmServer
from engine_helpers import support_triage
from grpc_health.v1 import health_pb2, health_pb2_grpc
from scripted_gemini.testing import fetch_calls, load_script, reset_calls

AGENT_TOPIC = "abada:agent"
POOL = "fault-pool"
# Text only a tool's arguments (and the model turn asking for the call) carry: never at rest in clear.
TOOL_ARGUMENT_MARKER = " [ref TRK-7731-ARGUMENT]"
# Text only the CRM's get_customer result carries (Alice's record).
TOOL_RESULT_MARKER = "alice.martin@example.com"

# Modest sizes for the suite: the drills in the issue ran 100 instances, which bench/fault_drill.py runs.
INSTANCES = 12
WORKERS = 2
CONCURRENCY = 4
LEASE_MS = 6_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_environment() -> dict[str, str]:
    """The developer's own ABADA_* / GEMINI_* settings must not leak into the services."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("ABADA_", "GEMINI_"))}


def write_private(path: pathlib.Path, text: str) -> pathlib.Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


def alice_bundle(
    crm_url: str, idempotency: str = "key", review_route: bool = False, outage_budget: str | None = None
) -> str:
    """Alice's triage; with `review_route`, an answer below the confidence threshold goes to a
    person's review task instead of an incident; `outage_budget` (ISO-8601) on the triage node."""
    return support_triage(
        crm_url,
        idempotency=idempotency,
        review_on=("low_confidence",) if review_route else (),
        node_extra=f"outage_budget: {outage_budget}" if outage_budget is not None else "",
    )


def alice_script(delay_ms: int = 0) -> dict[str, Any]:
    """Three turns: a read, a write whose subject names the instance's case, the answer."""
    customer = "{{input.customerId}}"
    return {
        "scripts": [
            {
                "name": "alice",
                "turns": [
                    {
                        "call": {"name": "crm__get_customer", "args": {"customerId": customer}},
                        "delay_ms": delay_ms,
                    },
                    {
                        "call": {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": customer,
                                "subject": "{{input.message}}" + TOOL_ARGUMENT_MARKER,
                                "priority": "high",
                            },
                        },
                        "delay_ms": delay_ms,
                    },
                    {
                        "json": {
                            "ticketId": "{{tool.crm__create_ticket.ticketId}}",
                            "priority": "high",
                            "_confidence": 95,
                        },
                        "delay_ms": delay_ms,
                    },
                ],
            }
        ]
    }


class Bearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(
            details._replace(metadata=[*(details.metadata or []), self._metadata]), request
        )


@dataclass
class ServiceProcess:
    """A child process in its own session, logging to a file; `kill` is a SIGKILL."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: pathlib.Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                self.argv,
                env={**clean_environment(), **self.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self, grace_seconds: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def tail(self, lines: int = 60) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def wait_for(condition, what: str, timeout: float, interval: float = 0.1) -> Any:  # type: ignore[no-untyped-def]
    """Polls `condition` (sync or async) until it returns something truthy; fails after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, grpc.RpcError):
            value = condition()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(interval)


def port_open(address: str) -> bool:
    host, _, port = address.rpartition(":")
    with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.2):
        return True
    return False


@dataclass
class Engine:
    """`abada-engine serve` on fixed ports, so a restart is found again at the same address."""

    service: ServiceProcess
    address: str
    http_address: str
    token: str

    async def start(self) -> None:
        self.service.start()
        await wait_for(lambda: port_open(self.address) or self._died(), "the engine listening", 60)
        self._died()

    def _died(self) -> bool:
        if not self.service.running:
            raise AssertionError(f"the engine exited:\n{self.service.tail()}")
        return False

    def kill(self) -> None:
        self.service.kill()

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address, interceptors=[Bearer(self.token)])


def engine_service(state: pathlib.Path, database_url: str, credentials_file: pathlib.Path) -> Engine:
    token = secrets.token_urlsafe(24)
    callers = {
        "callers": [
            {
                "identity": POOL,
                "roles": ["operator", "worker", "broker", "metrics"],
                "topics": ["*"],
                "act_as_any_worker": True,
                "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
            }
        ]
    }
    address, http_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    env = {
        "ABADA_DATABASE_URL": database_url,
        "ABADA_GRPC_ADDRESS": address,
        "ABADA_HTTP_ADDRESS": http_address,
        "ABADA_AUTH_TOKENS_FILE": str(write_private(state / "engine-callers.yaml", yaml.safe_dump(callers))),
        "ABADA_JOURNAL_KEYS": "fault:" + base64.b64encode(os.urandom(32)).decode(),
        "ABADA_IDEMPOTENCY_SECRET": secrets.token_urlsafe(32),
        "ABADA_STATE_DIR": str(state / "engine-state"),
        "ABADA_DEPLOY_CREDENTIALS_FILE": str(credentials_file),
        "ABADA_DB_POOL_SIZE": "10",
        "ABADA_LOG_LEVEL": "WARNING",
    }
    service = ServiceProcess(
        "engine", [sys.executable, "-m", "abada_engine.main", "serve"], env, state / "engine.log"
    )
    return Engine(service, address, http_address, token)


def broker_service(state: pathlib.Path, engine: Engine, crm_token: str) -> tuple[ServiceProcess, str]:
    address = f"127.0.0.1:{free_port()}"
    callers = {
        "callers": [
            {
                "identity": POOL,
                "roles": ["worker"],
                "token_sha256": hashlib.sha256(engine.token.encode()).hexdigest(),
            }
        ]
    }
    env = {
        "ABADA_BROKER_GRPC_ADDRESS": address,
        "ABADA_ENGINE_ADDRESS": engine.address,
        "ABADA_ENGINE_TOKEN_FILE": str(write_private(state / "broker-engine.token", engine.token)),
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(
            write_private(state / "broker-callers.yaml", yaml.safe_dump(callers))
        ),
        "ABADA_SECRET_BACKEND": "file",
        "ABADA_SECRETS_FILE": str(
            write_private(state / "secrets.yaml", yaml.safe_dump({"crm-token": crm_token}))
        ),
        "ABADA_LOG_LEVEL": "WARNING",
    }
    return ServiceProcess(
        "broker", [sys.executable, "-m", "abada_broker"], env, state / "broker.log"
    ), address


def worker_service(
    state: pathlib.Path,
    name: str,
    *,
    engine_address: str,
    token: str,
    broker_address: str,
    gemini_url: str,
    lease_ms: int,
    concurrency: int,
    extra: dict[str, str] | None = None,
) -> ServiceProcess:
    env = {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_BROKER_ADDRESS": broker_address,
        "ABADA_WORKER_ID": f"{POOL}/{name}",
        "ABADA_WORKER_TOKEN": token,
        "ABADA_WORKER_CONCURRENCY": str(concurrency),
        "ABADA_WORKER_HEALTH_ADDRESS": "127.0.0.1:0",
        "ABADA_WORKER_POLL_WAIT_MS": "1000",
        "ABADA_LEASE_MS": str(lease_ms),
        "ABADA_DRAIN_SECONDS": "2",
        "ABADA_GEMINI_BASE_URL": gemini_url,
        "GEMINI_API_KEY": "offline-fault-drill",
        **(extra or {}),
    }
    return ServiceProcess(
        f"worker-{name}", [sys.executable, "-m", "abada_worker.main"], env, state / f"worker-{name}.log"
    )


# --- driving and judging a drill ----------------------------------------------------------------------


@dataclass
class DrillOutcome:
    instances: int
    finished: int
    tickets_per_case: Counter[str]
    model_turns: int
    repaid_turns: int
    duplicate_keys: int
    stuck: list[str] = field(default_factory=list)

    def summary(self) -> str:
        one_each = sum(1 for count in self.tickets_per_case.values() if count == 1)
        return (
            f"instances={self.instances} finished={self.finished} tickets={sum(self.tickets_per_case.values())} "
            f"(one each: {one_each}) model_turns={self.model_turns} re-paid={self.repaid_turns} "
            f"duplicate_keys={self.duplicate_keys}"
        )

    def assert_clean(self) -> None:
        assert self.finished == self.instances, f"stuck: {self.stuck[:5]}; {self.summary()}"
        assert sorted(self.tickets_per_case.values()) == [1] * self.instances, self.summary()
        assert self.repaid_turns == 0, self.summary()
        assert self.duplicate_keys == 0, self.summary()


async def deploy(channel: grpc.aio.Channel, content: str) -> None:
    await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
        definition_pb2.DeployRequest(source_name="alice.yaml", content=content), timeout=30
    )


def case_name(drill: str, number: int) -> str:
    """Each instance's message, which the script copies into its ticket's subject."""
    return f"My parcel never arrived ({drill} case {number})"


async def start_instances(channel: grpc.aio.Channel, drill: str, count: int, first: int = 0) -> list[str]:
    from google.protobuf import struct_pb2

    stub = process_pb2_grpc.ProcessServiceStub(channel)
    ids = []
    for number in range(first, first + count):
        variables = struct_pb2.Struct()
        variables.update({"customerId": "C-42", "message": case_name(drill, number)})
        reply = await stub.StartInstance(
            process_pb2.StartInstanceRequest(process_id="support_triage", variables=variables), timeout=10
        )
        ids.append(reply.instance.id)
    return ids


async def unfinished(channel: grpc.aio.Channel, instance_ids: list[str]) -> list[str]:
    stub = process_pb2_grpc.ProcessServiceStub(channel)
    waiting = []
    for instance_id in instance_ids:
        found = (
            await stub.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id), timeout=5)
        ).instance
        if found.current_node_id != "notify_customer":
            waiting.append(instance_id)
    return waiting


async def wait_until_finished(channel_of, instance_ids: list[str], timeout: float) -> list[str]:  # type: ignore[no-untyped-def]
    """Polls until every instance reached notify_customer; returns the ones that did not in time."""
    deadline = time.monotonic() + timeout
    left = list(instance_ids)
    while left and time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):
            left = await unfinished(channel_of(), left)
        if left:
            await asyncio.sleep(0.5)
    return left


def judge(
    crm: RunningCrmServer, gemini_url: str, drill: str, instance_ids: list[str], stuck: list[str]
) -> DrillOutcome:
    expected = {case_name(drill, number) for number in range(len(instance_ids))}
    tickets = [t for t in crm.tickets() if t["subject"].removesuffix(TOOL_ARGUMENT_MARKER) in expected]
    per_case: Counter[str] = Counter(
        ticket["subject"].removesuffix(TOOL_ARGUMENT_MARKER) for ticket in tickets
    )
    for case in expected:
        per_case.setdefault(case, 0)
    keys = Counter(ticket["idempotencyKey"] for ticket in tickets if ticket.get("idempotencyKey"))
    calls = fetch_calls(gemini_url)
    played = sum(entry["count"] for entry in calls["counts"])
    repaid = sum(entry["count"] - 1 for entry in calls["repeated"])
    return DrillOutcome(
        instances=len(instance_ids),
        finished=len(instance_ids) - len(stuck),
        tickets_per_case=per_case,
        model_turns=played,
        repaid_turns=repaid,
        duplicate_keys=sum(count - 1 for count in keys.values() if count > 1),
        stuck=stuck,
    )


def database_dump(database_url: str) -> str | None:
    """`pg_dump --data-only` of the database (every table's rows, bytea as hex: sealed data stays
    sealed), or None where no pg_dump on this machine can dump that server (a newer major version)."""
    candidates = [shutil.which("pg_dump")]
    with contextlib.suppress(ImportError):
        import pgserver

        candidates.append(str(pathlib.Path(pgserver.__file__).parent / "pginstall" / "bin" / "pg_dump"))
    for pg_dump in candidates:
        if pg_dump is None or not os.path.exists(pg_dump):
            continue
        done = subprocess.run(
            [pg_dump, "--data-only", "--no-owner", "--dbname", database_url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout
    return None


async def plaintexts_at_rest(database_url: str, plaintexts: dict[str, str]) -> dict[str, list[str]]:
    """Searches a dump of the engine's database for each known plaintext; returns where each one was
    found (table: row). The dump is pg_dump's; without a usable pg_dump, every row of every table as
    text, which is what a data-only dump holds."""
    dump = await asyncio.to_thread(database_dump, database_url)
    if dump is not None:
        rows: list[tuple[str, str]] = []
        table = "?"
        for line in dump.splitlines():
            if line.startswith("COPY "):
                table = line.split()[1]
            elif line and not line.startswith(("--", "SET ", "SELECT ", "\\.")):
                rows.append((table, line))
    else:
        rows = await _rows_as_text(database_url)
    found: dict[str, list[str]] = {name: [] for name in plaintexts}
    for table, line in rows:
        for name, text in plaintexts.items():
            if text in line:
                found[name].append(f"{table}: {line[:200]}")
    return {name: where for name, where in found.items() if where}


async def _rows_as_text(database_url: str) -> list[tuple[str, str]]:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        tables = [
            row["tablename"]
            for row in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        ]
        rows = []
        for table in tables:
            rows += [
                (table, row["line"]) for row in await conn.fetch(f'SELECT t::text AS line FROM "{table}" t')
            ]
        return rows
    finally:
        await conn.close()


@contextlib.contextmanager
def stopped_at_exit(*services: ServiceProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for service in reversed(services):
            service.stop()


# --- the stack of one drill ------------------------------------------------------------------------


@dataclass
class Stack:
    engine: Engine
    broker: ServiceProcess
    broker_address: str
    crm: RunningCrmServer
    gemini_url: str
    state: pathlib.Path
    workers: list[ServiceProcess] = field(default_factory=list)
    # Settings every service of the stack gets on top of its own (OTEL_*, ABADA_LOG_LEVEL).
    env: dict[str, str] = field(default_factory=dict)

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
            extra={**self.env, **(extra or {})},
        )
        worker.start()
        self.workers.append(worker)
        return worker

    def logs(self) -> str:
        parts = [f"--- {self.engine.service.name}\n{self.engine.service.tail()}"]
        parts += [f"--- {w.name}\n{w.tail(30)}" for w in self.workers]
        return "\n".join(parts)


def _broker_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return answer.status == health_pb2.HealthCheckResponse.SERVING


@contextlib.asynccontextmanager
async def running_stack(
    state: pathlib.Path,
    database_url: str,
    crm: RunningCrmServer,
    gemini_url: str,
    idempotency: str = "key",
    env: dict[str, str] | None = None,
    review_route: bool = False,
    broker_env: dict[str, str] | None = None,
    outage_budget: str | None = None,
    script: dict[str, Any] | None = None,
) -> AsyncIterator[Stack]:
    """Engine and broker up, Alice's bundle deployed, the script loaded and its ledger empty; no workers.

    `env` is added to every service's own settings, workers added later included; `broker_env` to the
    broker's alone (a Vault backend instead of the file); `script` replaces Alice's plain one.
    """
    credentials = state / "deploy-credentials.yaml"
    credentials.write_text(yaml.safe_dump({"crm-token": crm.token}))
    engine = engine_service(state, database_url, credentials)
    broker, broker_address = broker_service(state, engine, crm.token)
    engine.service.env.update(env or {})
    broker.env.update({**(env or {}), **(broker_env or {})})
    stack = Stack(engine, broker, broker_address, crm, gemini_url, state, env=dict(env or {}))
    try:
        await engine.start()
        broker.start()
        await wait_for(lambda: _broker_serving(broker_address), "the broker serving", 60)
        async with engine.channel() as channel:
            await deploy(channel, alice_bundle(crm.url, idempotency, review_route, outage_budget))
        load_script(gemini_url, script or alice_script())
        reset_calls(gemini_url)
        yield stack
    finally:
        for worker in stack.workers:
            worker.kill()
        broker.stop()
        engine.service.stop()
