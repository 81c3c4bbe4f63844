"""The engine process while PostgreSQL (a server this test owns) is stopped and started again.

During the outage: an RPC is UNAVAILABLE with ErrorInfo DATABASE_UNAVAILABLE within the caller's
deadline (never INTERNAL, never a hang), grpc.health.v1 and /healthz say NOT_SERVING. After it: both
SERVING again without a restart of the engine, the pool reconnected, and the LISTEN/NOTIFY wake-up
works again: a task created after the outage reaches a long-polling worker within a second.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from fault_stack import Engine, engine_service, wait_for
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from owned_postgres import OwnedPostgres, owned_postgres

ONE_STEP = """
processes:
  - id: job
    start: work
    nodes:
      - { id: work, type: service, topic: outage-jobs, next: done }
      - { id: done, type: end }
"""


@pytest.fixture
def postgres() -> Iterator[OwnedPostgres]:
    with owned_postgres() as server:
        yield server


def _grpc_health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _http_health(engine: Engine) -> int:
    try:
        with urllib.request.urlopen(f"http://{engine.http_address}/healthz", timeout=2) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def _reason(error: grpc.aio.AioRpcError) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return ""


async def test_the_engine_says_unavailable_while_postgres_is_away_and_recovers_by_itself(tmp_path, postgres):
    credentials = tmp_path / "deploy-credentials.yaml"
    credentials.write_text("{}\n")
    engine = engine_service(tmp_path, postgres.url, credentials)
    await engine.start()
    try:
        async with engine.channel() as channel:
            await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
                definition_pb2.DeployRequest(source_name="job.yaml", content=ONE_STEP), timeout=30
            )
            processes = process_pb2_grpc.ProcessServiceStub(channel)
            tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
            assert _grpc_health(engine.address) == health_pb2.HealthCheckResponse.SERVING
            assert _http_health(engine) == 200

            await asyncio.to_thread(postgres.stop_immediately)
            began = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="job"), timeout=5)
            assert time.monotonic() - began < 5
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value.details()
            assert _reason(caught.value) == "DATABASE_UNAVAILABLE"
            await wait_for(
                lambda: _grpc_health(engine.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
                "grpc health NOT_SERVING",
                10,
            )
            assert _http_health(engine) == 503

            await asyncio.to_thread(postgres.start)
            await wait_for(
                lambda: _grpc_health(engine.address) == health_pb2.HealthCheckResponse.SERVING,
                "grpc health SERVING again",
                30,
            )
            assert _http_health(engine) == 200

            # The LISTEN connection is back too: a new task wakes a long poll at once, not at its timeout.
            poll = asyncio.ensure_future(
                tasks.FetchAndLock(
                    external_task_pb2.FetchAndLockRequest(
                        worker_id="w",
                        topics=[external_task_pb2.TopicSubscription(name="outage-jobs", lease_ms=5000)],
                        max_tasks=1,
                        wait_ms=20_000,
                    ),
                    timeout=30,
                )
            )
            await asyncio.sleep(
                0.5
            )  # the poll is waiting in the engine (a new task now would end it either way)
            started = await _start_when_serving(processes)
            created = time.monotonic()
            answer = await poll
            assert [task.instance_id for task in answer.tasks] == [started]
            assert time.monotonic() - created < 1.0
    finally:
        engine.service.stop()


async def _start_when_serving(processes: process_pb2_grpc.ProcessServiceStub) -> str:
    """The first StartInstance after the outage may still meet a connection the pool had not yet
    dropped; UNAVAILABLE says to send it again."""
    for _ in range(20):
        try:
            reply = await processes.StartInstance(
                process_pb2.StartInstanceRequest(process_id="job"), timeout=5
            )
            return reply.instance.id
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        await asyncio.sleep(0.2)
    raise AssertionError("the engine never took the instance after the outage")
