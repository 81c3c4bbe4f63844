"""Lists page by keyset: each row once while rows arrive and change, and tokens that cannot be forged (the
listing queries' plans at volume: test_engine_plans.py)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest
from abada.engine.v1 import (
    definition_pb2,
    external_task_pb2,
    incident_pb2,
    process_pb2,
    queue_pb2,
    queue_pb2_grpc,
)
from engine_helpers import GREET, complete, deploy, error_info, fetch, start, struct, upkeep_round
from google.protobuf import timestamp_pb2
from sqlalchemy import text

USER_TASK = """
processes:
  - id: review
    start: look
    nodes:
      - { id: look, type: user_task, next: done }
      - { id: done, type: end }
"""


async def _walk_instances(
    engine: Any, page_size: int, between: Callable[[], Awaitable[None]], **filters: Any
):
    seen: list[str] = []
    token = ""
    while True:
        response = await engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(page_size=page_size, page_token=token, **filters)
        )
        assert len(response.instances) <= page_size
        seen += [i.id for i in response.instances]
        token = response.next_page_token
        if not token:
            return seen
        await between()


async def test_instances_are_listed_by_when_they_started_and_pages_keep_the_range(engine):
    await deploy(engine, GREET)
    early = [(await start(engine, "greet")).id for _ in range(5)]
    await asyncio.sleep(0.05)
    between = datetime.now(UTC)
    await asyncio.sleep(0.05)
    late = [(await start(engine, "greet")).id for _ in range(7)]

    def stamp(moment: datetime) -> timestamp_pb2.Timestamp:
        value = timestamp_pb2.Timestamp()
        value.FromDatetime(moment)
        return value

    async def nothing() -> None:
        return None

    assert set(await _walk_instances(engine, 2, nothing, created_before=stamp(between))) == set(early)
    assert await _walk_instances(engine, 3, nothing, created_after=stamp(between)) == late[::-1]
    assert (
        await _walk_instances(engine, 3, nothing, created_after=stamp(between), created_before=stamp(between))
        == []
    )
    # A token is bound to its range: sent with another, it is refused.
    first = await engine.processes.ListInstances(
        process_pb2.ListInstancesRequest(page_size=2, created_after=stamp(between))
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(page_size=2, page_token=first.next_page_token)
        )
    assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"
    # A time no calendar holds is refused naming the field.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(created_before=timestamp_pb2.Timestamp(seconds=10**13))
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "created_before"


async def test_instances_are_found_by_their_variables_values(engine):
    await deploy(engine, GREET)
    alice = [(await start(engine, "greet", customerId="C-42", tier=2)).id for _ in range(3)]
    await start(engine, "greet", customerId="C-43", tier=2)
    await start(engine, "greet", customerId="C-420")
    await start(engine, "greet", customer={"customerId": "C-42"})

    def where(**values: Any) -> list[process_pb2.VariableEquals]:
        return [
            process_pb2.VariableEquals(name=n, value=struct({"v": v}).fields["v"]) for n, v in values.items()
        ]

    async def nothing() -> None:
        return None

    assert await _walk_instances(engine, 2, nothing, variables=where(customerId="C-42")) == alice[::-1]
    # Numbers compare as JSON numbers: 2.0 finds 2; the string "2" does not.
    assert len(await _walk_instances(engine, 10, nothing, variables=where(customerId="C-42", tier=2.0))) == 3
    assert await _walk_instances(engine, 10, nothing, variables=where(tier="2")) == []
    assert len(await _walk_instances(engine, 10, nothing, variables=where(tier=2))) == 4
    # A page token is bound to the values it was asked with.
    first = await engine.processes.ListInstances(
        process_pb2.ListInstancesRequest(page_size=1, variables=where(customerId="C-42"))
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(
                page_size=1, page_token=first.next_page_token, variables=where(customerId="C-43")
            )
        )
    assert error_info(caught.value).reason == "PAGE_TOKEN_INVALID"
    for bad, field in (
        ([process_pb2.VariableEquals(name="customerId")], "variables[0].value"),
        (where(**{"": 1}), "variables[0].name"),
        (where(**{f"v{n}": n for n in range(11)}), "variables"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await engine.processes.ListInstances(process_pb2.ListInstancesRequest(variables=bad))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value).metadata["field"] == field


async def test_walking_instances_sees_each_once_while_instances_start_and_finish(engine):
    await deploy(engine, GREET)
    before = [(await start(engine, "greet")).id for _ in range(40)]
    started_meanwhile: list[str] = []

    async def traffic() -> None:
        # New instances arrive, and some of the listed ones finish, between every two pages.
        for _ in range(3):
            started_meanwhile.append((await start(engine, "greet")).id)
        for task in await fetch(engine, "w", "greetings", max_tasks=2):
            await complete(engine, task, "w", {})

    seen = await _walk_instances(engine, 7, traffic)

    counts = Counter(seen)
    assert [i for i, n in counts.items() if n > 1] == []
    assert set(before) <= set(seen), "every instance that existed when the walk began is listed"
    assert set(seen) <= set(before) | set(started_meanwhile)
    # Newest first: the instances from before the walk come in the reverse of their start order.
    assert [i for i in seen if i in set(before)] == before[::-1]


async def test_walking_active_instances_never_repeats_one_as_others_finish(engine):
    await deploy(engine, GREET)
    before = [(await start(engine, "greet")).id for _ in range(30)]
    finished: set[str] = set()

    async def finish_some() -> None:
        await start(engine, "greet")
        for task in await fetch(engine, "w", "greetings", max_tasks=3):
            finished.add(task.instance_id)
            await complete(engine, task, "w", {})

    seen = await _walk_instances(engine, 5, finish_some, state=process_pb2.INSTANCE_STATE_ACTIVE)

    assert len(seen) == len(set(seen))
    # An instance still active at the end was active throughout: the walk must have shown it.
    still_active = set(before) - finished
    assert still_active <= set(seen)


async def test_filters_page_by_process_state_and_business_key(engine):
    await deploy(engine, GREET)
    await deploy(engine, USER_TASK)
    for n in range(6):
        await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(process_id="greet", business_key=f"order-{n % 2}")
        )
        await start(engine, "review")

    async def nothing() -> None:
        return None

    greet = await _walk_instances(engine, 2, nothing, process_id="greet")
    assert len(greet) == 6
    keyed = await _walk_instances(engine, 2, nothing, business_key="order-1")
    assert len(keyed) == 3
    for instance_id in keyed:
        found = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
        assert found.instance.business_key == "order-1"
    active_reviews = await _walk_instances(
        engine, 4, nothing, process_id="review", state=process_pb2.INSTANCE_STATE_ACTIVE
    )
    assert len(active_reviews) == 6


def _tampered(token: str) -> str:
    body, mac = token.split(".")
    raw = bytearray(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    raw[-3] ^= 1  # one bit of the last row's key
    return base64.urlsafe_b64encode(bytes(raw)).decode().rstrip("=") + "." + mac


async def _refused(call: Awaitable[Any]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(refused.value).reason == "PAGE_TOKEN_INVALID"
    assert "page_token" in (refused.value.details() or "")


async def test_a_tampered_forged_or_misused_page_token_is_refused(engine):
    await deploy(engine, GREET)
    for _ in range(3):
        await start(engine, "greet")
    first = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(page_size=1))
    token = first.next_page_token
    assert token

    await _refused(
        engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(page_size=1, page_token=_tampered(token))
        )
    )
    # A token with the engine's shape but signed by someone else, and one that is not a token at all.
    body = token.split(".")[0]
    forged = body + "." + base64.urlsafe_b64encode(b"\0" * 16).decode().rstrip("=")
    for bad in (forged, "o:100", "bm90IGEgdG9rZW4", "a.b.c", "!!!"):
        await _refused(
            engine.processes.ListInstances(process_pb2.ListInstancesRequest(page_size=1, page_token=bad))
        )
    # A good token sent with other filters than the ones it was issued for.
    await _refused(
        engine.processes.ListInstances(
            process_pb2.ListInstancesRequest(page_size=1, page_token=token, process_id="greet")
        )
    )
    # A good token of another list.
    await _refused(
        engine.definitions.ListDefinitions(definition_pb2.ListDefinitionsRequest(page_token=token))
    )
    # The genuine token still works.
    second = await engine.processes.ListInstances(
        process_pb2.ListInstancesRequest(page_size=1, page_token=token)
    )
    assert second.instances[0].id != first.instances[0].id


async def test_queue_incidents_user_tasks_and_definitions_page_with_tokens(engine):
    await deploy(engine, GREET)
    await deploy(engine, USER_TASK)
    greeted = {(await start(engine, "greet")).id for _ in range(5)}
    reviewed = {(await start(engine, "review")).id for _ in range(5)}
    queue = queue_pb2_grpc.QueueServiceStub(engine.channel)

    async def walk(call: Callable[[str], Awaitable[Any]], field: str) -> list[Any]:
        rows: list[Any] = []
        token = ""
        while True:
            response = await call(token)
            rows += list(getattr(response, field))
            token = response.next_page_token
            if not token:
                return rows

    tasks = await walk(
        lambda t: queue.ListTasks(queue_pb2.ListTasksRequest(page_size=2, page_token=t)), "tasks"
    )
    assert sorted(t.instance_id for t in tasks) == sorted(greeted)
    user_tasks = await walk(
        lambda t: engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(page_size=2, page_token=t)),
        "user_tasks",
    )
    assert sorted(t.instance_id for t in user_tasks) == sorted(reviewed)
    definitions = await walk(
        lambda t: engine.definitions.ListDefinitions(
            definition_pb2.ListDefinitionsRequest(page_size=1, page_token=t)
        ),
        "definitions",
    )
    assert sorted(d.process_id for d in definitions) == ["greet", "review"]

    for task in await fetch(engine, "w", "greetings", max_tasks=5):
        await engine.tasks.Fail(_failure(task))
    incidents = await walk(
        lambda t: engine.incidents.ListIncidents(
            incident_pb2.ListIncidentsRequest(page_size=2, page_token=t)
        ),
        "incidents",
    )
    assert sorted(i.instance_id for i in incidents) == sorted(greeted)
    await _refused(queue.ListTasks(queue_pb2.ListTasksRequest(page_token="x" + tasks[0].id)))


def _failure(task: Any) -> external_task_pb2.FailRequest:
    return external_task_pb2.FailRequest(
        task_id=task.id, worker_id="w", lease_token=task.lease_token, error_message="no", no_retry=True
    )


def test_page_tokens_round_trip_their_key_and_expire_nothing():
    """A token carries its key exactly (a time with its zone, an id), whatever the order of filters."""
    from abada_engine.paging import PageTokens, listing

    tokens = PageTokens.derived_from(b"s" * 32)
    name = listing("instances", state="ACTIVE", process_id="p")
    assert name == listing("instances", process_id="p", state="ACTIVE")
    page = tokens.page(2, "", name, (datetime, uuid.UUID))
    key = (datetime(2026, 12, 4, 13, 0, 0, 123456, tzinfo=UTC), uuid.uuid4())
    token = tokens.next_token(page, 3, key)
    assert tokens.page(2, token, name, (datetime, uuid.UUID)).after == key
    assert tokens.next_token(page, 2, key) == "", "no token after the last page"
    other = PageTokens.derived_from(b"t" * 32)
    with pytest.raises(Exception, match="page_token"):
        other.page(2, token, name, (datetime, uuid.UUID))


async def test_the_queue_upkeep_vacuums_a_hot_table_past_its_threshold(engine, db):
    from abada_engine.store import upkeep as upkeep_store

    await deploy(engine, GREET)
    for _ in range(20):
        await start(engine, "greet")
    async with db.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("UPDATE tasks SET attempt = attempt"))
        # Statistics reach the shared counters when a session goes idle, at most once a second unless forced.
        await conn.execute(text("SELECT pg_stat_force_next_flush()"))
        await conn.execute(text("SELECT 1"))
        dead = (await upkeep_store.table_changes(conn, ["tasks"]))["tasks"].dead
    assert dead >= 20

    assert await upkeep_round(db, {"tasks": 10_000}) == 0, "below its threshold a table is left alone"
    await upkeep_round(db, {"tasks": 20})
    async with db.connect() as conn:
        assert (await upkeep_store.table_changes(conn, ["tasks"]))["tasks"].dead == 0


async def test_the_queue_upkeep_analyzes_a_hot_table_after_a_share_of_its_rows_changed(engine, db):
    """ANALYZE reads a sample of the whole table, so it waits for the threshold plus a tenth of the rows
    to change: a large history is not read again every few thousand changes of a small queue."""
    from abada_engine.store import upkeep as upkeep_store

    # `dependencies`, a hot table the engine under test leaves alone here: 1,000 circuits, all up.
    async def run(sql: str) -> tuple[upkeep_store.TableChanges, int]:
        async with db.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text(sql))
            # Statistics reach the shared counters when a session goes idle, at most once a second unless forced.
            await conn.execute(text("SELECT pg_stat_force_next_flush()"))
            await conn.execute(text("SELECT 1"))
            changes = (await upkeep_store.table_changes(conn, ["dependencies"]))["dependencies"]
            analyzed = await conn.scalar(
                text("SELECT analyze_count FROM pg_stat_user_tables WHERE relname = 'dependencies'")
            )
        return changes, int(analyzed)

    circuit = "SELECT 'test:' || n, 'test', n::text, 'UP', now() FROM generate_series(1, 1000) n"
    # Autovacuum is kept off the table meanwhile: migration 0008 has it vacuum and analyze `dependencies`
    # after 200 inserts, and a visit of its own between two steps here would do the upkeep's work.
    await run("ALTER TABLE dependencies SET (autovacuum_enabled = off)")
    try:
        await run(f"INSERT INTO dependencies (key, kind, name, state, updated_at) {circuit}")
        counted, analyzed = await run("ANALYZE dependencies")
        assert counted.rows == 1000

        # 50 changes: past the vacuum's 10 dead rows, short of 10 plus a tenth of 1,000 rows.
        changed = "UPDATE dependencies SET updated_at = now() WHERE key IN (SELECT key FROM dependencies "
        await run(changed + "WHERE kind = 'test' ORDER BY key LIMIT 50)")
        await upkeep_round(db, {"dependencies": 10})
        counted, analyzed_now = await run("SELECT 1")
        assert counted.dead == 0, "vacuumed"
        assert analyzed_now == analyzed, "not analyzed: 50 of 1,000 rows changed"

        # 60 more: 110 changed since the last ANALYZE, the threshold plus a tenth of the rows.
        await run(changed + "WHERE kind = 'test' ORDER BY key DESC LIMIT 60)")
        await upkeep_round(db, {"dependencies": 10})
        counted, analyzed_now = await run("SELECT 1")
        assert analyzed_now == analyzed + 1
        assert counted.changed_since_analyze == 0
    finally:
        await run("DELETE FROM dependencies WHERE kind = 'test'")
        await run("ALTER TABLE dependencies RESET (autovacuum_enabled)")
