"""Starts and Completes that arrive together share one statement and one commit, and each is still checked
and answered on its own."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence

import grpc
from abada.engine.v1 import process_pb2
from abada_common.group_commit import GroupCommit
from engine_helpers import (
    GREET,
    ONE_AGENT_TASK,
    complete,
    deploy,
    error_info,
    fetch,
    history_types,
    leased,
    start,
)
from engine_helpers import instance as instance_of
from sqlalchemy import text


async def test_starts_arriving_together_share_commits_and_each_is_whole(engine, db):
    await deploy(engine, GREET)
    started = await asyncio.gather(*(start(engine, "greet", n=n) for n in range(40)))
    assert len({i.id for i in started}) == 40
    assert sorted(i.variables["n"] for i in started) == list(range(40))
    # Fewer transactions than starts.
    assert await transactions_writing(db, "instances") < 40
    for instance in started[:5]:
        assert await history_types(engine, instance.id) == [
            ("INSTANCE_STARTED", ""),
            ("NODE_ENTERED", "hello"),
            ("TASK_CREATED", "hello"),
        ]
    tasks = await fetch(engine, "w", "greetings", max_tasks=50)
    assert sorted(t.instance_id for t in tasks) == sorted(i.id for i in started)
    assert {t.variables["n"] for t in tasks} == set(range(40))


async def test_a_write_that_fails_in_a_group_fails_alone():
    groups: list[list[int]] = []

    async def write_group(items: Sequence[int]) -> list[str]:
        groups.append(list(items))
        await asyncio.sleep(0.01)
        if 13 in items:
            raise ValueError("thirteen is refused")
        return [f"wrote {i}" for i in items]

    commit: GroupCommit[int, str] = GroupCommit(write_group, each_alone_on_failure=True)
    results = await asyncio.gather(*(commit.submit(i) for i in range(20)), return_exceptions=True)
    assert [r for r in results if isinstance(r, Exception)] == [results[13]]
    assert str(results[13]) == "thirteen is refused"
    assert [r for i, r in enumerate(results) if i != 13] == [f"wrote {i}" for i in range(20) if i != 13]
    # All twenty arrived together and went as one group; when it failed, each was written alone.
    assert groups == [list(range(20)), *([i] for i in range(20))]


async def test_a_caller_that_gives_up_does_not_stop_the_others():
    release = asyncio.Event()

    async def write_group(items: Sequence[int]) -> list[int]:
        await release.wait()
        return list(items)

    commit: GroupCommit[int, int] = GroupCommit(write_group)
    first = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0)
    impatient = asyncio.ensure_future(commit.submit(2))
    patient = asyncio.ensure_future(commit.submit(3))
    await asyncio.sleep(0.01)
    impatient.cancel()
    release.set()
    assert await first == 1
    assert await patient == 3
    assert impatient.cancelled()


async def test_a_failed_batch_whose_caller_gave_up_logs_nothing() -> None:
    release = asyncio.Event()

    async def write_group(items: Sequence[int]) -> list[int]:
        await release.wait()
        raise ConnectionError("the pool is closed")

    unhandled: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unhandled.append(context))
    commit: GroupCommit[int, int] = GroupCommit(write_group)
    impatient = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0.01)
    impatient.cancel()
    await asyncio.sleep(0)
    release.set()
    await asyncio.sleep(0.01)
    del impatient
    gc.collect()
    assert [c["message"] for c in unhandled] == []


async def transactions_writing(db, rows: str) -> int:
    """How many transactions last wrote these rows: a row carries the id of the one that wrote it (xmin)."""
    async with db.connect() as conn:
        return (await conn.execute(text(f"SELECT count(DISTINCT xmin::text) FROM {rows}"))).scalar()


async def test_completes_arriving_together_share_commits_and_a_refused_one_changes_nothing(engine, db):
    tasks = await leased(engine, ONE_AGENT_TASK, "think", "abada:agent", 30)
    stale, *others = tasks
    stale_token = type(stale)()
    stale_token.CopyFrom(stale)
    stale_token.lease_token = "stale"
    results = await asyncio.gather(
        complete(engine, stale_token, "w", {"answer": {"n": -1}}),
        *(complete(engine, task, "w", {"answer": {"task": task.id}}) for task in others),
        return_exceptions=True,
    )
    refused, *completed = results
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert error_info(refused).reason == "NOT_LEASE_HOLDER"
    assert all(not isinstance(c, BaseException) and c.next_node_id == "done" for c in completed), completed
    for task in others:
        found = await instance_of(engine, task.instance_id)
        assert found.state == process_pb2.INSTANCE_STATE_COMPLETED
        assert found.variables["answer"]["task"] == task.id
    still = await instance_of(engine, stale.instance_id)
    assert still.current_node_id == "agent" and "answer" not in still.variables
    # The refused Complete left the task with its holder, who can still complete it.
    await complete(engine, stale, "w", {"answer": {"n": 0}})
    assert await transactions_writing(db, "instances WHERE current_node_id = 'done'") < len(others)
