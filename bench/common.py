"""Shared bench plumbing: a scratch database, an engine subprocess, the raw commit rate, percentiles."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import os
import pathlib
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import asyncpg
import grpc


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """A fresh database on ABADA_BENCH_DATABASE_URL / ABADA_TEST_DATABASE_URL, else an embedded pgserver."""
    admin_url = os.environ.get("ABADA_BENCH_DATABASE_URL") or os.environ.get("ABADA_TEST_DATABASE_URL")
    if not admin_url:
        import pgserver

        with tempfile.TemporaryDirectory(prefix="abada-bench-") as data_dir:
            server = pgserver.get_server(data_dir, cleanup_mode="stop")
            yield server.get_uri()
            server.cleanup()
        return
    name = f"abada_bench_{secrets.token_hex(4)}"

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


@dataclass
class EngineProcess:
    address: str
    http_address: str
    token: str
    process: subprocess.Popen[bytes]

    def channel(self) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(self.address, interceptors=[_Bearer(self.token)])

    def cpu_seconds(self) -> float:
        """CPU time the engine (and its serving processes, if several) has used so far: a cost per
        call that a busy machine stretches much less than it stretches the wall clock. Not its
        due-time process: it serves no call, and its start-up would land on the first call measured."""
        import psutil

        parent = psutil.Process(self.process.pid)
        total = 0.0
        for member in [parent, *parent.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                if "fire-due-times" in member.cmdline():
                    continue
                times = member.cpu_times()
                total += times.user + times.system
        return total


class _Bearer(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(
            details._replace(metadata=[*(details.metadata or []), self._metadata]), request
        )


@contextlib.contextmanager
def engine_process(database_url: str, extra_env: dict[str, str] | None = None) -> Iterator[EngineProcess]:
    port, http_port = free_port(), free_port()
    token = secrets.token_urlsafe(24)
    state_dir = tempfile.TemporaryDirectory(prefix="abada-bench-state-")
    state = state_dir.name
    callers = pathlib.Path(state) / "callers.yaml"
    callers.write_text(
        "callers:\n  - identity: bench\n    roles: [operator, worker, broker, metrics]\n    topics: ['*']\n"
        f"    act_as_any_worker: true\n    token_sha256: {hashlib.sha256(token.encode()).hexdigest()}\n"
    )
    env = {
        **os.environ,
        "ABADA_DATABASE_URL": database_url,
        "ABADA_GRPC_ADDRESS": f"127.0.0.1:{port}",
        "ABADA_HTTP_ADDRESS": f"127.0.0.1:{http_port}",
        "ABADA_AUTH_TOKENS_FILE": str(callers),
        "ABADA_JOURNAL_KEYS": "bench:" + base64.b64encode(os.urandom(32)).decode(),
        "ABADA_IDEMPOTENCY_SECRET": secrets.token_urlsafe(32),
        "ABADA_STATE_DIR": state,
        "ABADA_LOG_LEVEL": "WARNING",
        **(extra_env or {}),
    }
    # Another checkout's engine, to compare two versions on one machine in one run.
    other_source = os.environ.get("ABADA_BENCH_ENGINE_SRC")
    if other_source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [other_source, env.get("PYTHONPATH")]))
    process = subprocess.Popen([sys.executable, "-m", "abada_engine.main", "serve"], env=env)
    try:
        _wait_for_port(port, process)
        _wait_for_due_time_process(process)
        yield EngineProcess(f"127.0.0.1:{port}", f"127.0.0.1:{http_port}", token, process)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        state_dir.cleanup()


def _wait_for_port(port: int, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("the engine exited during start-up")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.1)
    raise RuntimeError("the engine did not start listening")


def _wait_for_due_time_process(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """Until the engine's due-time process has started (it nices itself once its imports are done),
    so its start-up does not share the CPU with the first figures measured. An engine without one
    (`ABADA_DUE_TIME_PROCESS=0`, or an older engine) is not waited for."""
    import psutil

    engine = psutil.Process(process.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = [c for c in engine.children() if "fire-due-times" in c.cmdline()]
        if not children and time.monotonic() > deadline - timeout + 2:
            return
        if children and children[0].nice() > engine.nice():
            return
        time.sleep(0.1)


async def raw_commit_rate(database_url: str, connections: int = 8, seconds: float = 3.0) -> float:
    """Single-row INSERTs, each its own committed transaction, from `connections` concurrent clients."""
    setup = await asyncpg.connect(database_url)
    await setup.execute(
        "DROP TABLE IF EXISTS bench_raw; CREATE TABLE bench_raw (id bigserial PRIMARY KEY, v text)"
    )
    await setup.close()
    deadline = time.monotonic() + seconds
    counts = [0] * connections

    async def client(index: int) -> None:
        conn = await asyncpg.connect(database_url)
        statement = await conn.prepare("INSERT INTO bench_raw (v) VALUES ($1)")
        while time.monotonic() < deadline:
            await statement.fetch("x")
            counts[index] += 1
        await conn.close()

    begun = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(connections)))
    return sum(counts) / (time.monotonic() - begun)


@contextlib.asynccontextmanager
async def timed() -> AsyncIterator[list[float]]:
    holder = [time.perf_counter()]
    yield holder
    holder.append(time.perf_counter())


async def bare_grpc_rate(address: str, callers: int = 8, calls: int = 4000) -> float:
    """Unary calls/s that do nothing (grpc.health.v1 Check) on the same engine: the floor gRPC sets."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channels = [grpc.aio.insecure_channel(address) for _ in range(callers)]
    stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]

    async def caller(stub: health_pb2_grpc.HealthStub) -> None:
        for _ in range(calls // callers):
            await stub.Check(health_pb2.HealthCheckRequest())

    began = time.perf_counter()
    await asyncio.gather(*(caller(stub) for stub in stubs))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    return calls / elapsed
