"""The agent worker's runs on the SDK's worker parts, against the real engine: concurrency, lease
renewal, drain, backoff."""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from abada_engine.api.guard import Guard
from abada_engine.api.server import ServerTls, start_grpc_server
from abada_engine.auth import CallerRegistry
from abada_sdk.connection import BearerToken
from abada_sdk.worker import Backoff, Executor, Poller
from abada_worker.engine_client import EagerDispatch, EngineClient, LeaseRef
from abada_worker.errors import AttemptFailed
from abada_worker.interruption import TaskInterruption
from abada_worker.main import engine_channel_for
from abada_worker.settings import load_settings
from abada_worker.task_runs import AgentRuns, TaskHandler
from certificates import make_pki
from worker_support import deploy_bundle, history_of, instance_of, start_instance

TOPIC = "worker-jobs"
BUNDLE = f"""
processes:
  - id: jobs
    start: work
    nodes:
      - {{ id: work, type: service, topic: {TOPIC}, next: done }}
      - {{ id: done, type: end }}
"""


@pytest.fixture
async def client(engine, engine_tokens) -> AsyncIterator[EngineClient]:  # type: ignore[no-untyped-def]
    async with grpc.aio.insecure_channel(engine.address) as channel:
        # The suite's token may serve any topic under any worker id.
        yield EngineClient(
            channel, "executor-test-worker", BearerToken(engine_tokens.suite), retry_seconds=2.0
        )


def executor_for(client: EngineClient, job: TaskHandler, *, lease_ms: int, concurrency: int) -> Executor:
    """The agent worker's executor (main.py): the SDK's slots, the agent's runs."""
    runs = AgentRuns(client, {TOPIC: job}, lease_ms=lease_ms)
    return Executor(runs.start, runs.release, concurrency=concurrency)


def poller_for(
    client: EngineClient, executor: Executor, *, lease_ms: int, wait_ms: int, backoff: Backoff | None = None
) -> Poller:
    return Poller(
        lambda max_tasks: client.fetch_and_lock(TOPIC, lease_ms, max_tasks, wait_ms),
        executor,
        wait_ms=wait_ms,
        backoff=backoff,
    )


async def finish(client: EngineClient, task: external_task_pb2.ExternalTask, **variables: object) -> None:
    await client.complete(
        LeaseRef(task.id, task.lease_token, task.attempt),
        dict(variables),
        external_task_pb2.AttemptMetadata(),
    )


async def wait_until(predicate, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def all_completed(engine, instance_ids: list[str]) -> bool:  # type: ignore[no-untyped-def]
    states = [(await instance_of(engine, i)).state for i in instance_ids]
    return all(state == process_pb2.INSTANCE_STATE_COMPLETED for state in states)


async def test_tasks_run_side_by_side_up_to_the_concurrency_and_leases_outlive_their_length(
    engine, client
) -> None:
    await deploy_bundle(engine, BUNDLE)
    instance_ids = [await start_instance(engine, "jobs", n=n) for n in range(6)]
    running = 0
    most_at_once = 0

    async def slow_job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        nonlocal running, most_at_once
        running += 1
        most_at_once = max(most_at_once, running)
        try:
            # Longer than the 2 s lease: only the lease keeper lets Complete through.
            await asyncio.sleep(2.6)
        finally:
            running -= 1
        await finish(client, task, done=True)

    # 2 s, not 1 s: a loaded CI machine can stall the loop long enough to miss a 330 ms renewal.
    executor = executor_for(client, slow_job, lease_ms=2_000, concurrency=3)
    stopping = asyncio.Event()
    poller = asyncio.create_task(poller_for(client, executor, lease_ms=2_000, wait_ms=200).run(stopping))
    try:
        await wait_until(lambda: all_completed(engine, instance_ids), timeout=15)
    finally:
        stopping.set()
        await poller
        await executor.drain(time.monotonic())

    assert most_at_once == 3
    for instance_id in instance_ids:
        types = [event.type for event in await history_of(engine, instance_id)]
        assert "TASK_FAILED" not in types


async def test_with_eager_dispatch_each_complete_brings_the_next_task_into_the_freed_slot(
    engine, client
) -> None:
    await deploy_bundle(engine, BUNDLE)
    instance_ids = [await start_instance(engine, "jobs", n=n) for n in range(3)]
    running = 0
    most_at_once = 0

    async def job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        nonlocal running, most_at_once
        running += 1
        most_at_once = max(most_at_once, running)
        try:
            await finish(client, task, done=True)
        finally:
            running -= 1

    executor = executor_for(client, job, lease_ms=10_000, concurrency=1)
    handed_over: list[str] = []

    def hand_over(task: external_task_pb2.ExternalTask) -> None:
        handed_over.append(task.id)
        executor.hand_over(task)

    client.eager = EagerDispatch(TOPIC, 10_000, hand_over)
    stopping = asyncio.Event()
    poller = asyncio.create_task(poller_for(client, executor, lease_ms=10_000, wait_ms=200).run(stopping))
    try:
        await wait_until(lambda: all_completed(engine, instance_ids), timeout=15)
    finally:
        client.eager.enabled = False
        stopping.set()
        await poller
        await executor.drain(time.monotonic())
    # One poll fetched the first task (one free slot); each Complete brought the next one.
    assert len(handed_over) == 2
    assert most_at_once == 1


async def test_a_failure_is_reported_and_an_unknown_topic_is_refused(engine, client) -> None:
    await deploy_bundle(engine, BUNDLE)
    instance_id = await start_instance(engine, "jobs")

    async def broken_job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        raise AttemptFailed("CRM_DOWN", "the CRM is down", no_retry=True)

    executor = executor_for(client, broken_job, lease_ms=5_000, concurrency=1)
    (task,) = await client.fetch_and_lock(TOPIC, 5_000, 1, 0)
    executor.submit(task)
    await executor.drain(time.monotonic() + 5)

    failed = [event for event in await history_of(engine, instance_id) if event.type == "TASK_FAILED"]
    assert len(failed) == 1
    assert failed[0].data["code"] == "CRM_DOWN"
    assert (await instance_of(engine, instance_id)).open_incidents == 1


async def test_at_the_drain_deadline_a_side_effect_finishes_and_anything_else_is_left_to_lapse(
    engine, client
) -> None:
    await deploy_bundle(engine, BUNDLE)
    writer_id = await start_instance(engine, "jobs", role="writer")
    thinker_id = await start_instance(engine, "jobs", role="thinker")
    cut_off: list[str] = []

    async def job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        if task.variables["role"] == "writer":
            with interruption.side_effect():
                await asyncio.sleep(0.6)
                await finish(client, task, written=True)
            return
        interruption.begun = True  # as the journal marks it: this attempt has spent something
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cut_off.append(task.id)
            raise

    executor = executor_for(client, job, lease_ms=5_000, concurrency=2)
    for task in await client.fetch_and_lock(TOPIC, 5_000, 2, 0):
        executor.submit(task)
    await asyncio.sleep(0.1)

    started = time.monotonic()
    await executor.drain(started + 0.2)

    assert time.monotonic() - started < 2
    assert (await instance_of(engine, writer_id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    assert len(cut_off) == 1
    thinker_history = [event.type for event in await history_of(engine, thinker_id)]
    assert "TASK_FAILED" not in thinker_history and "TASK_COMPLETED" not in thinker_history
    # Nothing was reported: the lease is still the dead worker's until it lapses.
    assert await client.fetch_and_lock(TOPIC, 5_000, 1, 0) == []


async def test_at_the_drain_deadline_a_task_that_journaled_nothing_is_handed_back_for_the_next_worker(
    engine, client
) -> None:
    await deploy_bundle(engine, BUNDLE)
    waiting_id = await start_instance(engine, "jobs", role="waiting")

    async def job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        await asyncio.sleep(30)  # e.g. still waiting for a tool server: no step journaled yet

    executor = executor_for(client, job, lease_ms=60_000, concurrency=1)
    [task] = await client.fetch_and_lock(TOPIC, 60_000, 1, 0)
    executor.submit(task)
    await executor.drain(time.monotonic() + 0.1)

    # Offered again at once (not in 60 s), no retry spent: no failure was counted.
    [again] = await client.fetch_and_lock(TOPIC, 5_000, 1, 0)
    assert (again.id, again.attempt, again.retries_left) == (task.id, task.attempt + 1, task.retries_left)
    await finish(client, again, done=True)
    history = [event.type for event in await history_of(engine, waiting_id)]
    assert "TASK_RELEASED" in history and "TASK_FAILED" not in history


async def test_a_poll_answered_after_the_stop_hands_its_tasks_back(engine, client) -> None:
    await deploy_bundle(engine, BUNDLE)
    ran: list[str] = []

    async def job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        ran.append(task.id)

    executor = executor_for(client, job, lease_ms=60_000, concurrency=2)
    polled = asyncio.Event()
    fetch_and_lock = client.fetch_and_lock

    async def observed_fetch(*args, **kwargs):  # type: ignore[no-untyped-def]
        polled.set()
        return await fetch_and_lock(*args, **kwargs)

    client.fetch_and_lock = observed_fetch  # type: ignore[method-assign]
    poller = poller_for(client, executor, lease_ms=60_000, wait_ms=3_000)
    stopping = asyncio.Event()
    polling = asyncio.create_task(poller.run(stopping))
    await asyncio.wait_for(polled.wait(), timeout=5)  # a long poll is on its way
    stopping.set()
    instance_id = await start_instance(engine, "jobs", role="late")  # locked by the poll in flight
    await asyncio.wait_for(polling, timeout=10)

    assert ran == []
    [again] = await client.fetch_and_lock(TOPIC, 5_000, 1, 0)
    assert again.attempt == 2  # the poll's own hand-out, given back unstarted
    await finish(client, again, done=True)
    assert (await instance_of(engine, instance_id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_an_unreachable_engine_is_polled_with_backoff_and_work_resumes_when_it_is_back(
    engine, engine_core, engine_tokens
) -> None:
    await deploy_bundle(engine, BUNDLE)
    instance_id = await start_instance(engine, "jobs")
    guard = Guard(CallerRegistry(engine_tokens.callers_file))
    # The port is held, bound but not listening, until the engine comes up on it: connections are
    # refused meanwhile, and no other program on the machine can take the port in between.
    reserved = socket.socket()
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    reserved.bind(("127.0.0.1", 0))
    port = reserved.getsockname()[1]
    attempts: list[float] = []

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        client = EngineClient(channel, "backoff-worker", BearerToken(engine_tokens.suite), retry_seconds=1.0)
        original = client.fetch_and_lock

        async def counted(*args: object) -> list[external_task_pb2.ExternalTask]:
            attempts.append(time.monotonic())
            return await original(*args)  # type: ignore[arg-type]

        client.fetch_and_lock = counted  # type: ignore[method-assign]

        async def job(task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
            await finish(client, task, resumed=True)

        executor = executor_for(client, job, lease_ms=5_000, concurrency=1)
        stopping = asyncio.Event()
        poller = asyncio.create_task(
            poller_for(client, executor, lease_ms=5_000, wait_ms=200, backoff=Backoff(0.05, 0.4)).run(
                stopping
            )
        )

        # Polled, not a fixed wait: a loaded machine makes fewer tries in a given time, never more.
        async def five_tries() -> bool:
            return len(attempts) >= 5

        await wait_until(five_tries, timeout=30)
        failed_attempts = len(attempts)
        server = await start_grpc_server(engine_core, f"127.0.0.1:{port}", guard, shared_port=True)
        reserved.close()
        try:
            await wait_until(lambda: all_completed(engine, [instance_id]), timeout=10)
        finally:
            stopping.set()
            await poller
            await executor.drain(time.monotonic() + 5)
            await server.stop(0)

    # Backing off from 50 ms, doubling up to 400 ms (each pause within 20 % of that), not a busy loop:
    # every gap is at least its pause, so the fourth is at least 0.32 s.
    assert failed_attempts >= 5
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts[:5])]
    for n, gap in enumerate(gaps):
        assert gap >= 0.8 * min(0.05 * 2**n, 0.4), gaps


async def test_the_worker_reaches_a_tls_engine_with_its_client_certificate(
    engine, engine_core, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    await deploy_bundle(engine, BUNDLE)
    await start_instance(engine, "jobs")
    pki = make_pki(tmp_path, client_cn="tls-worker")
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        "callers:\n  - {identity: tls-worker, roles: [worker], topics: [worker-jobs], certificate_cn: tls-worker}\n"
    )
    running = await start_grpc_server(
        engine_core,
        "127.0.0.1:0",
        Guard(CallerRegistry(callers)),
        ServerTls(pki.server_cert, pki.server_key, pki.ca_pem),
    )
    settings = load_settings(
        [],
        {
            "ABADA_ENGINE_ADDRESS": f"127.0.0.1:{running.port}",
            "ABADA_TLS_CA_FILE": str(pki.ca),
            "ABADA_TLS_CERT_FILE": str(pki.client_cert),
            "ABADA_TLS_KEY_FILE": str(pki.client_key),
        },
    )
    channel = engine_channel_for(settings)
    try:
        tasks = await EngineClient(channel, "tls-worker", BearerToken(None)).fetch_and_lock(
            TOPIC, 5_000, 1, 0
        )
    finally:
        await channel.close()
        await running.stop(0)

    assert [task.topic_name for task in tasks] == [TOPIC]
