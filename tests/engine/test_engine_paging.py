"""Lists page by keyset: each row once while rows arrive and change, tokens that cannot be forged, and every
listing query answered by an index at volume (EXPLAIN, no sequential scan, no sort of more than a page)."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
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
from abada_engine.store import approvals as approval_store
from abada_engine.store import definitions as definition_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import instances as instance_store
from abada_engine.store import tasks as task_store
from abada_engine.store.approvals import ApprovalListing
from abada_engine.store.incidents import IncidentListing
from abada_engine.store.instances import InstanceListing
from engine_helpers import GREET, complete, deploy, error_info, fetch, start, struct, upkeep_round
from google.protobuf import timestamp_pb2
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

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


# --- Every listing query, at volume, reads a page from an index -----------------------------------------

INSTANCES = 20_000
ACTIVE = 100
PAGE = 50


async def _fill(db: AsyncEngine) -> dict[str, Any]:
    """INSTANCES instances of two processes, nearly all finished, with a task, an incident and an approval
    per ten instances: enough that the planner prefers an index where one fits, and sorts when none does."""
    statements = [
        """INSERT INTO definitions (id, process_id, version, content_sha256, source_name, spec, tool_bindings,
                                    created_at)
           SELECT gen_random_uuid(), p, 1, p, 'x', '{}', '[]', now() FROM unnest(ARRAY['a', 'b']) p""",
        f"""INSERT INTO instances (id, definition_id, process_id, version, state, variables, current_node_id,
                                   business_key, created_at, ended_at)
            SELECT gen_random_uuid(), d.id, d.process_id, 1,
                   CASE WHEN n <= {ACTIVE} THEN 'ACTIVE' WHEN n % 50 = 0 THEN 'CANCELED' ELSE 'COMPLETED' END,
                   jsonb_build_object('customerId', 'C-' || (n % 1000), 'n', n), 'done', 'key-' || n,
                   now() - n * interval '1 second', now()
            FROM generate_series(1, {INSTANCES}) n
            JOIN definitions d ON d.process_id = CASE WHEN n % 2 = 0 THEN 'a' ELSE 'b' END""",
        """INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at,
                              created_at, outage_waits)
           SELECT gen_random_uuid(), i.id, 'work', CASE WHEN i.state = 'ACTIVE' AND i.business_key LIKE '%7'
                                                       THEN 'user' ELSE 'external' END,
                  't' || (abs(hashtext(i.id::text)) % 5),
                  CASE WHEN i.state = 'ACTIVE' AND i.business_key LIKE '%7' THEN 'WAITING'
                       WHEN i.state = 'ACTIVE' THEN 'READY' ELSE 'COMPLETED' END,
                  '{}', 1, 0, now(), i.created_at, 0
           FROM instances i""",
        """INSERT INTO incidents (id, instance_id, task_id, node_id, type, message, details, state, created_at)
           SELECT gen_random_uuid(), t.instance_id, t.id, 'work',
                  CASE WHEN abs(hashtext(t.id::text)) % 20 = 0 THEN 'FAILED_TASK' ELSE 'INVALID_OUTPUT' END, 'm', '{}',
                  CASE WHEN t.state = 'READY' THEN 'OPEN' ELSE 'RESOLVED' END, t.created_at
           FROM tasks t WHERE abs(hashtext(t.id::text)) % 10 = 0 OR t.state = 'READY'""",
        """INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version,
                                      input_tokens, output_tokens, abandoned, created_at, updated_at)
           SELECT t.id, 1, 1, 'TOOL_CALL', 'AWAITING_APPROVAL', 'crm/x', 'k', 1, 0, 0, false, now(), now()
           FROM tasks t""",
        """INSERT INTO approvals (id, task_id, sequence, instance_id, node_id, tool_ref, state, created_at)
           SELECT gen_random_uuid(), t.id, 1, t.instance_id, 'work', 'crm/x',
                  CASE WHEN t.state = 'READY' THEN 'PENDING' ELSE 'APPROVED' END, t.created_at
           FROM tasks t WHERE abs(hashtext(t.id::text)) % 10 = 1 OR t.state = 'READY'""",
    ]
    async with db.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement))
    async with db.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("ANALYZE definitions, instances, tasks, incidents, journal_steps, approvals"))
        deep = (
            await conn.execute(
                text(
                    "SELECT created_at, id FROM instances ORDER BY created_at DESC, id DESC OFFSET 15000 LIMIT 1"
                )
            )
        ).one()
        task = (
            await conn.execute(text("SELECT created_at, id FROM tasks WHERE state = 'READY' LIMIT 1"))
        ).one()
    return {"deep": (deep.created_at, deep.id), "task": (task.created_at, task.id)}


def _problems(plan: dict[str, Any], limit: int) -> list[str]:
    found = []
    node = plan["Node Type"]
    if node == "Seq Scan" and plan["Relation Name"] != "definitions":
        found.append(f"a sequential scan of {plan['Relation Name']}")
    if node in ("Sort", "Incremental Sort") and plan["Actual Rows"] > limit:
        found.append(f"a sort of {plan['Actual Rows']} rows")
    # An index that yields rows the query then throws away reads more than a page to fill one.
    if plan.get("Rows Removed by Filter", 0) > limit:
        found.append(
            f"{node} on {plan.get('Index Name', '')} read {plan['Rows Removed by Filter']} rows it dropped"
        )
    for child in plan.get("Plans", []):
        found += _problems(child, limit)
    return found


async def test_every_listing_query_reads_one_page_from_an_index_at_volume(engine, db):
    keys = await _fill(db)
    deep: tuple[datetime, uuid.UUID] = keys["deep"]
    after_task: tuple[datetime, uuid.UUID] = keys["task"]
    limit = PAGE + 1
    hour = timedelta(hours=1)
    listings: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "instances": lambda c: instance_store.listed(c, limit=limit),
        "instances, deep": lambda c: instance_store.listed(c, limit=limit, after_key=deep),
        "active instances": lambda c: instance_store.listed(c, InstanceListing(state="ACTIVE"), limit=limit),
        "active instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(state="ACTIVE"), limit=limit, after_key=deep
        ),
        "completed instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(state="COMPLETED"), limit=limit, after_key=deep
        ),
        "canceled instances": lambda c: instance_store.listed(
            c, InstanceListing(state="CANCELED"), limit=limit
        ),
        "one process's instances": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a"), limit=limit
        ),
        "one process's instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a"), limit=limit, after_key=deep
        ),
        "one process's active instances": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a", state="ACTIVE"), limit=limit
        ),
        "one process's completed instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a", state="COMPLETED"), limit=limit, after_key=deep
        ),
        "a business key's instances": lambda c: instance_store.listed(
            c, InstanceListing(business_key="key-77"), limit=limit
        ),
        "instances of an hour, deep": lambda c: instance_store.listed(
            c,
            InstanceListing(created_after=deep[0] - hour, created_before=deep[0] + hour),
            limit=limit,
            after_key=deep,
        ),
        "one process's completed instances of an hour, deep": lambda c: instance_store.listed(
            c,
            InstanceListing(process_id="a", state="COMPLETED", created_after=deep[0] - hour),
            limit=limit,
            after_key=deep,
        ),
        "instances with a variable's value": lambda c: instance_store.listed(
            c, InstanceListing(variables_holding={"customerId": "C-77"}), limit=limit
        ),
        "one process's instances with two variables' values": lambda c: instance_store.listed(
            c, InstanceListing(process_id="b", variables_holding={"customerId": "C-77", "n": 77}), limit=limit
        ),
        "completed instances before a time": lambda c: instance_store.listed(
            c, InstanceListing(state="COMPLETED", created_before=deep[0]), limit=limit
        ),
        "one instance": lambda c: instance_store.listed(c, instance_id=deep[1], limit=1),
        "queued tasks": lambda c: task_store.open_external_tasks(c, None, None, limit),
        "queued tasks, after": lambda c: task_store.open_external_tasks(c, None, None, limit, after_task),
        "one topic's queued tasks": lambda c: task_store.open_external_tasks(
            c, "t1", None, limit, after_task
        ),
        "one instance's queued tasks": lambda c: task_store.open_external_tasks(c, None, deep[1], limit),
        "waiting user tasks": lambda c: task_store.waiting_user_tasks(c, None, limit, after_task),
        "open incidents": lambda c: incident_store.listed(c, IncidentListing(state="OPEN"), limit=limit),
        "open incidents of a type, after": lambda c: incident_store.listed(
            c, IncidentListing(state="OPEN", type="FAILED_TASK"), limit=limit, after_key=after_task
        ),
        "resolved incidents": lambda c: incident_store.listed(
            c, IncidentListing(state="RESOLVED"), limit=limit
        ),
        "pending approvals": lambda c: approval_store.listed(
            c, ApprovalListing(state="PENDING"), limit=limit
        ),
        "approved approvals, after": lambda c: approval_store.listed(
            c, ApprovalListing(state="APPROVED"), limit=limit, after_key=(after_task[0], after_task[1], 1)
        ),
        "definitions": lambda c: definition_store.listed(c, limit=limit, after_key=("a", 1)),
    }
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        captured.append((statement, parameters))

    failures = {}
    for name, run in listings.items():
        captured.clear()
        async with db.connect() as conn:
            # Only this connection's statements: the engine under test shares the connection pool.
            event.listen(conn.sync_connection, "before_cursor_execute", capture)
            await run(conn)
        [(statement, parameters)] = captured
        async with db.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            plan = await raw.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, *parameters)
        problems = _problems(_json(plan)[0]["Plan"], limit)
        if problems:
            failures[name] = problems
    assert failures == {}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


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
