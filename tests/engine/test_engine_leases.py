"""Leases: exactly-once hand-out under concurrency, expiry, renewal, and refusing non-holders."""

from __future__ import annotations

import asyncio
import datetime as dt
import time

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import (
    ONE_SERVICE_TASK,
    complete,
    deploy,
    error_info,
    fetch,
    instance,
    plain,
    start,
    until_lease_ran_out,
)
from sqlalchemy import text


async def _start_many(db, count: int) -> None:
    """Start instances in bulk through the domain API (500 gRPC round trips would only slow the test)."""
    from abada_engine.definitions.catalog import DefinitionCatalog
    from abada_engine.runtime.instances import Instances

    instances = Instances(db, DefinitionCatalog(db))
    for _ in range(count):
        await instances.start("job", 0, {})


async def test_twenty_concurrent_fetchers_over_500_tasks_get_each_task_exactly_once(engine, db):
    await deploy(engine, ONE_SERVICE_TASK)
    await _start_many(db, 500)
    received: dict[str, list[str]] = {}

    async def fetcher(worker: str) -> None:
        while True:
            tasks = await fetch(engine, worker, "jobs", max_tasks=7)
            if not tasks:
                return
            for task in tasks:
                received.setdefault(task.id, []).append(worker)

    await asyncio.gather(*(fetcher(f"w{i}") for i in range(20)))
    assert len(received) == 500
    assert all(len(holders) == 1 for holders in received.values())
    assert len({h[0] for h in received.values()}) > 1  # the work really was shared


async def test_expired_lease_is_offered_again_with_the_next_attempt_and_the_old_holder_is_refused(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    # 3 s: the second fetch must come while the lease holds, even on a loaded machine.
    [first] = await fetch(engine, "slow-worker", "jobs", lease_ms=3000)
    assert first.attempt == 1
    assert await fetch(engine, "other", "jobs") == []  # live lease: nobody else gets it
    await until_lease_ran_out(first)
    [second] = await fetch(engine, "fast-worker", "jobs")
    assert (second.id, second.attempt) == (first.id, 2)
    assert second.lease_token != first.lease_token

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(engine, first, "slow-worker", {"result": "late"})
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
    assert "result" not in dict((await instance(engine, started.id)).variables)

    await complete(engine, second, "fast-worker", {"result": "on time"})
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_after_an_outage_a_holder_gets_a_grace_to_come_back_before_its_expired_lease_is_taken(
    engine, engine_core
):
    """The engine starting again, or its database coming back: nobody could renew a lease meanwhile."""
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [held] = await fetch(engine, "cut-off", "jobs", lease_ms=1000)
    await until_lease_ran_out(held)
    engine_core.leases.hold_takeovers(2.0)  # as when the database answers again
    asked = time.monotonic()
    assert await fetch(engine, "other", "jobs") == []
    # The holder comes back within the grace: its lease is re-granted, same attempt, same token.
    await engine.tasks.ExtendLease(
        external_task_pb2.ExtendLeaseRequest(
            task_id=held.id, worker_id="cut-off", lease_token=held.lease_token, lease_ms=1000
        )
    )
    await until_lease_ran_out(held)
    # A holder that does not come back: a long poll takes the task over when the grace ends, not before.
    [taken] = await fetch(engine, "other", "jobs", wait_ms=5000)
    waited = time.monotonic() - asked
    assert (taken.id, taken.attempt) == (held.id, 2)
    assert 2.0 <= waited < 4.5, waited


async def test_complete_after_expiry_by_the_holder_is_lease_expired_and_changes_nothing(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs", lease_ms=1000)
    await until_lease_ran_out(task)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(engine, task, "w", {"x": 1})
    assert error_info(caught.value).reason == "LEASE_EXPIRED"
    assert (await instance(engine, started.id)).current_node_id == "work"


async def test_wrong_token_and_wrong_worker_are_refused_alike(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    forged = external_task_pb2.ExternalTask()
    forged.CopyFrom(task)
    forged.lease_token = "not-the-token"
    for worker, candidate in (("w", forged), ("intruder", task)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await complete(engine, candidate, worker, {})
        assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await engine.tasks.ExtendLease(
                external_task_pb2.ExtendLeaseRequest(
                    task_id=task.id, worker_id=worker, lease_token=candidate.lease_token, lease_ms=5000
                )
            )
        assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"


async def test_extend_lease_keeps_the_task_from_others(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    # Renewed every 0.5 s for 2.5 s each time: a stall of up to 2 s between renewals is survived.
    [task] = await fetch(engine, "w", "jobs", lease_ms=2500)
    first_expiry = task.lease_expires_at.ToDatetime(tzinfo=dt.UTC)
    renewals = 0
    while dt.datetime.now(dt.UTC) < first_expiry + dt.timedelta(seconds=0.5):  # well past the first lease
        assert renewals < 40, "bounded: the first lease's end never came"
        await asyncio.sleep(0.5)
        extended = await engine.tasks.ExtendLease(
            external_task_pb2.ExtendLeaseRequest(
                task_id=task.id, worker_id="w", lease_token=task.lease_token, lease_ms=2500
            )
        )
        renewals += 1
        assert extended.lease_expires_at.ToDatetime() > task.lease_expires_at.ToDatetime()
        assert await fetch(engine, "other", "jobs") == []
    # Past the first lease's end, still the holder's.
    assert await fetch(engine, "other", "jobs") == []
    await complete(engine, task, "w", {})


async def test_long_poll_is_woken_by_new_work_not_by_a_timer(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    waiting = asyncio.create_task(fetch(engine, "w", "jobs", wait_ms=10_000))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await start(engine, "job")
    begun = time.monotonic()
    tasks = await asyncio.wait_for(waiting, timeout=5)
    assert len(tasks) == 1
    # Woken by the new task's notification, long before the 10 s wait would have run out (the bound is
    # loose for a loaded machine, where the engine shares the test's event loop).
    assert time.monotonic() - begun < 3.0


async def test_long_poll_returns_empty_when_the_wait_runs_out(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    begun = time.monotonic()
    assert await fetch(engine, "w", "jobs", wait_ms=400) == []
    assert 0.35 < time.monotonic() - begun < 5.0  # it waited, and it stopped (generous for a loaded machine)


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"worker_id": "", "max_tasks": 1}, "worker_id"),
        ({"worker_id": "w", "max_tasks": 0}, "max_tasks"),
        ({"worker_id": "w", "max_tasks": 1, "wait_ms": -1}, "wait_ms"),
    ],
)
async def test_bad_fetch_requests_name_the_field(engine, request_fields, field):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.FetchAndLock(
            external_task_pb2.FetchAndLockRequest(
                topics=[external_task_pb2.TopicSubscription(name="jobs", lease_ms=5000)], **request_fields
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == field


async def test_lease_duration_out_of_range_is_refused(engine):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fetch(engine, "w", "jobs", lease_ms=10)
    assert error_info(caught.value).metadata["field"] == "topics[0].lease_ms"


async def test_lease_token_is_stored_only_as_a_hash(engine, db):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    async with db.connect() as conn:
        stored = (await conn.execute(text("SELECT lease_token_hash FROM tasks"))).scalar_one()
    assert task.lease_token.encode() not in bytes(stored)
    assert len(bytes(stored)) == 32


async def test_complete_with_fetch_next_answers_with_the_workers_next_tasks(engine, db):
    """Eager dispatch: the answer to a Complete carries the next tasks, locked like a fetch locks them."""
    await deploy(engine, ONE_SERVICE_TASK)
    await _start_many(db, 3)
    [first] = await fetch(engine, "w", "jobs", max_tasks=1)
    answer = await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=first.id,
            worker_id="w",
            lease_token=first.lease_token,
            fetch_next=external_task_pb2.FetchNext(
                topics=[external_task_pb2.TopicSubscription(name="jobs", lease_ms=60_000)], max_tasks=5
            ),
        )
    )
    assert answer.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    handed = list(answer.next_tasks)
    assert len(handed) == 2 and first.id not in {t.id for t in handed}
    assert await fetch(engine, "other", "jobs") == []  # both are under the worker's lease now
    for task in handed:  # and the worker holds them like any fetched task
        await complete(engine, task, "w", {})
    async with db.connect() as conn:
        states = (await conn.execute(text("SELECT state, count(*) FROM tasks GROUP BY state"))).all()
    assert dict(states) == {"COMPLETED": 3}


async def test_a_bad_fetch_next_is_refused_before_the_task_is_completed(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.Complete(
            external_task_pb2.CompleteRequest(
                task_id=task.id,
                worker_id="w",
                lease_token=task.lease_token,
                fetch_next=external_task_pb2.FetchNext(
                    topics=[external_task_pb2.TopicSubscription(name="jobs", lease_ms=10)], max_tasks=1
                ),
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "fetch_next.topics[0].lease_ms"
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_ACTIVE
    await complete(engine, task, "w", {})  # the lease still holds: nothing changed


async def test_a_task_handed_back_unstarted_is_offered_again_at_once_without_a_retry_spent(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    [task] = await fetch(engine, "stopping-worker", "jobs", lease_ms=60_000)
    assert task.attempt == 1
    await engine.tasks.ReleaseLease(
        external_task_pb2.ReleaseLeaseRequest(
            task_id=task.id, worker_id="stopping-worker", lease_token=task.lease_token, reason="SIGTERM"
        )
    )
    # Offered again now, not when the 60 s lease would have run out, and no failure was counted.
    [again] = await fetch(engine, "other", "jobs", wait_ms=0)
    assert (again.id, again.attempt, again.retries_left) == (task.id, 2, task.retries_left)
    assert again.lease_token != task.lease_token
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(engine, task, "stopping-worker", {})
    assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
    await complete(engine, again, "other", {})
    events = (await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))).events
    released = [event for event in events if event.type == "TASK_RELEASED"]
    assert len(released) == 1 and plain(released[0].data) == {
        "worker_id": "stopping-worker",
        "reason": "SIGTERM",
    }


async def test_only_the_holder_may_hand_a_task_back(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.ReleaseLease(
            external_task_pb2.ReleaseLeaseRequest(
                task_id=task.id, worker_id="intruder", lease_token=task.lease_token
            )
        )
    assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
    assert await fetch(engine, "other", "jobs") == []
