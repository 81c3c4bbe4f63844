"""ABADA_ENGINE_PROCESSES: several engine processes serve one gRPC port, sharing the work."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import secrets
import socket
import sys
import time

import grpc
import psutil
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from bearer import BearerToken

BUNDLE = """
processes:
  - id: spread
    start: work
    nodes:
      - { id: work, type: service, topic: spread, next: done }
      - { id: done, type: end }
"""
CHANNELS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _poll(condition, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        await asyncio.sleep(0.05)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _listens_on(process: psutil.Process, port: int) -> bool:
    return any(c.laddr.port == port and c.status == "LISTEN" for c in process.net_connections("tcp"))


def _connections_on(process: psutil.Process, port: int) -> int:
    return sum(
        1 for c in process.net_connections("tcp") if c.laddr.port == port and c.status == "ESTABLISHED"
    )


def _serving(parent: psutil.Process) -> list[psutil.Process]:
    """The engine processes `parent` started to serve beside it (not its due-time process)."""
    return [child for child in parent.children() if "serve" in child.cmdline()]


async def test_two_processes_share_one_port_and_complete_each_others_tasks(database_url, tmp_path):
    token = secrets.token_urlsafe(24)
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        "callers:\n  - identity: spread\n    roles: [operator, worker]\n    topics: ['*']\n"
        f"    act_as_any_worker: true\n    token_sha256: {hashlib.sha256(token.encode()).hexdigest()}\n"
    )
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env.update(
        ABADA_DATABASE_URL=database_url,
        ABADA_GRPC_ADDRESS=f"127.0.0.1:{port}",
        ABADA_HTTP_ADDRESS=f"127.0.0.1:{_free_port()}",
        ABADA_AUTH_TOKENS_FILE=str(callers),
        ABADA_JOURNAL_KEYS="k:" + base64.b64encode(os.urandom(32)).decode(),
        ABADA_IDEMPOTENCY_SECRET=secrets.token_urlsafe(32),
        ABADA_STATE_DIR=str(tmp_path / "state"),
        ABADA_ENGINE_PROCESSES="2",
        ABADA_LOG_LEVEL="WARNING",
    )
    engine = await asyncio.create_subprocess_exec(sys.executable, "-m", "abada_engine.main", "serve", env=env)
    parent = psutil.Process(engine.pid)
    try:
        await _poll(lambda: _listening(port) and len(_serving(parent)) == 1, "the second process starting")
        [child] = _serving(parent)
        await _poll(lambda: _listens_on(child, port), "the second process listening")
        channels = [
            grpc.aio.insecure_channel(
                f"127.0.0.1:{port}",
                # Its own connection each: channels with equal arguments would share one.
                options=[("grpc.use_local_subchannel_pool", 1)],
                interceptors=[BearerToken(token)],
            )
            for _ in range(CHANNELS)
        ]
        try:
            tasks = [external_task_pb2_grpc.ExternalTaskServiceStub(c) for c in channels]
            await definition_pb2_grpc.DefinitionServiceStub(channels[0]).Deploy(
                definition_pb2.DeployRequest(source_name="spread.yaml", content=BUNDLE)
            )
            processes = process_pb2_grpc.ProcessServiceStub(channels[0])
            started = [
                (
                    await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="spread"))
                ).instance.id
                for _ in range(CHANNELS)
            ]
            subscription = external_task_pb2.TopicSubscription(name="spread", lease_ms=60_000)
            for index in range(CHANNELS):
                [task] = (
                    await tasks[index].FetchAndLock(
                        external_task_pb2.FetchAndLockRequest(
                            worker_id="w", max_tasks=1, topics=[subscription]
                        )
                    )
                ).tasks
                # Completed through another connection, so often through the other process.
                await tasks[(index + 1) % CHANNELS].Complete(
                    external_task_pb2.CompleteRequest(
                        task_id=task.id, worker_id="w", lease_token=task.lease_token
                    )
                )
            for instance_id in started:
                instance = await processes.GetInstance(
                    process_pb2.GetInstanceRequest(instance_id=instance_id)
                )
                assert instance.instance.state == process_pb2.INSTANCE_STATE_COMPLETED
            # The kernel spread the connections over both processes.
            assert _connections_on(parent, port) > 0 and _connections_on(child, port) > 0
        finally:
            for channel in channels:
                await channel.close()
        engine.terminate()
        await asyncio.wait_for(engine.wait(), 30)
        await _poll(
            lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
            "the second process stopping",
        )
    finally:
        if engine.returncode is None:
            engine.kill()
            await engine.wait()
