"""Letting old data go: retention per process, an operator's purge, one customer's erasure."""

from __future__ import annotations

import datetime as dt
from typing import Any

import grpc
import httpx2
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_engine.api.http import HttpServer, build_app
from abada_engine.auth import CallerRegistry
from abada_engine.errors import EngineError
from abada_engine.runtime.queue_stats import QueueStats
from abada_engine.runtime.retention import Retention
from engine_helpers import append, complete, deploy, error_info, fetch, instance, start, struct
from google.protobuf import timestamp_pb2
from sqlalchemy import text

# `triage` keeps the default 30 days; `quick` keeps nothing after its end; `reply` waits for a message.
BUNDLE = """
processes:
  - id: triage
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Triage ${message}
        result_variable: triage
        next: done
      - { id: done, type: end }
  - id: quick
    retention: P0D
    start: call
    nodes:
      - { id: call, type: service, topic: quick-call, retries: 0, next: done }
      - { id: done, type: end }
  - id: reply
    retention: P7D
    start: await_reply
    nodes:
      - id: await_reply
        type: receive
        message: customer_reply
        correlation_key: "${ticket}"
        result_variable: reply
        timeout: PT1H
        on_timeout: done
        next: done
      - { id: done, type: end }
"""

# Every table holding an instance's rows, and how a row names its instance.
_OWNED = {
    "instances": "id = ANY(:ids)",
    "tasks": "instance_id = ANY(:ids)",
    "history": "instance_id = ANY(:ids)",
    "incidents": "instance_id = ANY(:ids)",
    "approvals": "instance_id = ANY(:ids)",
    "timers": "instance_id = ANY(:ids)",
    "messages": "correlated_instance_id = ANY(:ids)",
    "start_requests": "instance_id = ANY(:ids)",
    "journal_steps": "task_id IN (SELECT id FROM tasks WHERE instance_id = ANY(:ids))",
}


async def _rows_of(db, instance_ids: list[str]) -> dict[str, int]:
    """How many rows each table holds for these instances (tasks' journal steps counted by task id, kept
    in a temporary list first: the tasks may be gone while the steps stay)."""
    import uuid

    ids = [uuid.UUID(i) for i in instance_ids]
    async with db.connect() as conn:
        counts = {}
        for table, condition in _OWNED.items():
            counts[table] = (
                await conn.execute(text(f"SELECT count(*) FROM {table} WHERE {condition}"), {"ids": ids})
            ).scalar_one()
        return counts


async def _task_ids(db, instance_id: str) -> list[Any]:
    async with db.connect() as conn:
        return list(
            (
                await conn.execute(
                    text("SELECT id FROM tasks WHERE instance_id = CAST(:i AS uuid)"), {"i": instance_id}
                )
            ).scalars()
        )


async def _steps_of(db, task_ids: list[Any]) -> int:
    async with db.connect() as conn:
        return (
            await conn.execute(
                text("SELECT count(*) FROM journal_steps WHERE task_id = ANY(:t)"), {"t": task_ids}
            )
        ).scalar_one()


async def _ended_days_ago(db, instance_id: str, days: float) -> None:
    async with db.begin() as conn:
        await conn.execute(
            text(
                "UPDATE instances SET ended_at = now() - make_interval(secs => :s) WHERE id = CAST(:i AS uuid)"
            ),
            {"s": days * 86_400, "i": instance_id},
        )


async def _finished_triage(engine, customer: str, business_key: str = "") -> process_pb2.Instance:
    """A triage that ran one journaled model call and completed."""
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="triage",
            variables=struct({"message": "parcel lost", "customerId": customer}),
            business_key=business_key,
            request_id=f"start-{customer}-{business_key}",
        )
    )
    [task] = await fetch(engine, "w", "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0, "customer": customer})
    await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "done"}, tokens=(10, 2))
    await complete(engine, task, "w", {"triage": {"priority": "high"}})
    done = await instance(engine, started.instance.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    return done


async def _failed_and_canceled_quick(engine) -> process_pb2.Instance:
    """A `quick` whose call failed into an incident, then was cancelled."""
    started = await start(engine, "quick")
    [task] = await fetch(engine, "w", "quick-call")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id, worker_id="w", lease_token=task.lease_token, error_code="E", error_message="no"
        )
    )
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=started.id, reason="x")
    )
    return await instance(engine, started.id)


async def _retention_round(engine_core) -> int:
    # The engine's own periodic round may hold the job at this moment: ask again until this one runs.
    for _ in range(50):
        if (deleted := await engine_core.retention.round()) or not await _held(engine_core):
            return deleted
    raise AssertionError("the retention job stayed held by another round")


async def _held(engine_core) -> bool:
    async with engine_core.db.connect() as conn:
        return bool(
            (
                await conn.execute(
                    # Advisory locks are per database: another database's engine (a benchmark on the
                    # same server) holding its own retention lock does not hold this one's.
                    text(
                        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = :k"
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    ),
                    {"k": 0x61626164_0002 & 0xFFFFFFFF},
                )
            ).scalar_one()
        )


async def test_versions_deployed_before_retention_existed_keep_their_instances(engine, engine_core, db):
    """An upgrade deletes nothing by itself: a version deployed before retention has none recorded, and
    the job leaves its instances for an operator's purge."""
    await deploy(engine, BUNDLE)
    old = await _finished_triage(engine, "C-9")
    await _ended_days_ago(db, old.id, 400)
    async with db.begin() as conn:
        await conn.execute(text("UPDATE definitions SET retention_seconds = NULL"))
    await _retention_round(engine_core)
    assert (await _rows_of(db, [old.id]))["instances"] == 1
    # Deploying the same processes again records their retention on those versions from then on.
    redeployed = await deploy(engine, BUNDLE)
    assert not redeployed.created_process_ids
    async with db.connect() as conn:
        recorded = (
            await conn.execute(text("SELECT retention_seconds FROM definitions WHERE process_id = 'triage'"))
        ).scalar_one()
    assert recorded == 30 * 86_400
    purged = await engine.processes.PurgeInstances(
        process_pb2.PurgeInstancesRequest(before=_time(dt.datetime.now(dt.UTC)))
    )
    assert purged.instances == 1
    assert (await _rows_of(db, [old.id]))["instances"] == 0


async def test_retention_deletes_the_finished_instances_past_it_with_every_row_and_nothing_else(
    engine, engine_core, db
):
    await deploy(engine, BUNDLE)
    old = await _finished_triage(engine, "C-1")
    recent = await _finished_triage(engine, "C-2")
    old_tasks, recent_tasks = await _task_ids(db, old.id), await _task_ids(db, recent.id)
    assert await _steps_of(db, old_tasks) == 1
    active = await start(engine, "triage", message="still going")
    await _ended_days_ago(db, old.id, 31)
    await _ended_days_ago(db, recent.id, 29)
    # An active instance is never deleted, however old.
    async with db.begin() as conn:
        await conn.execute(
            text("UPDATE instances SET created_at = now() - interval '400 days' WHERE id = CAST(:i AS uuid)"),
            {"i": active.id},
        )
    before = await _rows_of(db, [old.id])
    assert before["instances"] == 1 and before["tasks"] == 1 and before["history"] > 3
    assert before["start_requests"] == 1

    await _retention_round(engine_core)

    assert set((await _rows_of(db, [old.id])).values()) == {0}
    assert await _steps_of(db, old_tasks) == 0
    kept = await _rows_of(db, [recent.id, active.id])
    assert kept["instances"] == 2 and kept["history"] > 3 and await _steps_of(db, recent_tasks) == 1
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await instance(engine, old.id)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert (await instance(engine, recent.id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    assert (await instance(engine, active.id)).state == process_pb2.INSTANCE_STATE_ACTIVE


async def test_p0d_keeps_nothing_after_the_end_and_each_process_keeps_its_own(engine, engine_core, db):
    await deploy(engine, BUNDLE)
    canceled = await _failed_and_canceled_quick(engine)
    assert canceled.state == process_pb2.INSTANCE_STATE_CANCELED
    assert (await _rows_of(db, [canceled.id]))["incidents"] == 1
    waiting = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id="reply", variables=struct({"ticket": "T-1"}))
    )
    await engine.processes.PublishMessage(
        process_pb2.PublishMessageRequest(
            name="customer_reply", correlation_key="T-1", variables=struct({"a": 1})
        )
    )
    replied = await instance(engine, waiting.instance.id)
    assert replied.state == process_pb2.INSTANCE_STATE_COMPLETED
    rows = await _rows_of(db, [replied.id])
    assert rows["messages"] == 1 and rows["timers"] == 1
    # Six days after its end a P7D instance stays; eight days after, it goes.
    await _ended_days_ago(db, replied.id, 6)
    await _retention_round(engine_core)  # the P0D one goes at once
    assert set((await _rows_of(db, [canceled.id])).values()) == {0}
    assert (await _rows_of(db, [replied.id]))["instances"] == 1
    await _ended_days_ago(db, replied.id, 8)
    await _retention_round(engine_core)
    assert set((await _rows_of(db, [replied.id])).values()) == {0}


def _time(value: dt.datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


async def test_purge_counts_with_dry_run_then_deletes_what_ended_before_the_time(engine, db):
    await deploy(engine, BUNDLE)
    first = await _finished_triage(engine, "C-1")
    second = await _finished_triage(engine, "C-2")
    active = await start(engine, "triage", message="still going")
    await _ended_days_ago(db, first.id, 2)
    cut = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
    dry = await engine.processes.PurgeInstances(
        process_pb2.PurgeInstancesRequest(before=_time(cut), dry_run=True)
    )
    assert (dry.instances, dry.rows, dry.dry_run) == (1, 0, True)
    assert (await _rows_of(db, [first.id]))["instances"] == 1
    other_process = await engine.processes.PurgeInstances(
        process_pb2.PurgeInstancesRequest(before=_time(cut), process_id="quick")
    )
    assert other_process.instances == 0
    purged = await engine.processes.PurgeInstances(
        process_pb2.PurgeInstancesRequest(before=_time(cut), process_id="triage")
    )
    assert purged.instances == 1 and purged.rows > 5
    assert set((await _rows_of(db, [first.id])).values()) == {0}
    assert (await _rows_of(db, [second.id, active.id]))["instances"] == 2
    # Everything finished before now: the active one stays.
    everything = await engine.processes.PurgeInstances(
        process_pb2.PurgeInstancesRequest(before=_time(dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)))
    )
    assert everything.instances == 1
    assert (await instance(engine, active.id)).state == process_pb2.INSTANCE_STATE_ACTIVE
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await engine.processes.PurgeInstances(process_pb2.PurgeInstancesRequest())
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(missing.value).metadata["field"] == "before"


async def _tables_naming(db, needle: str) -> dict[str, int]:
    """Every table of the engine's schema whose rows, as text, contain `needle`."""
    async with db.connect() as conn:
        tables = (
            await conn.execute(
                text(
                    "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema() "
                    "AND table_type = 'BASE TABLE'"
                )
            )
        ).scalars()
        found = {}
        for table in list(tables):
            count = (
                await conn.execute(
                    text(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE :needle'),
                    {"needle": f"%{needle}%"},
                )
            ).scalar_one()
            if count:
                found[table] = count
        return found


async def test_erasure_leaves_no_row_naming_the_key_and_one_audit_row(engine, db):
    await deploy(engine, BUNDLE)
    key = "CUST-7f3a9"
    done = await _finished_triage(engine, "C-9", business_key=key)
    other = await _finished_triage(engine, "C-10", business_key="CUST-other")
    active = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="reply", variables=struct({"ticket": key}), business_key=key
        )
    )
    # A message buffered for the customer's key, that no instance took yet.
    await engine.processes.PublishMessage(
        process_pb2.PublishMessageRequest(name="unrelated", correlation_key=key, variables=struct({"k": key}))
    )
    assert await _tables_naming(db, key)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await engine.processes.EraseInstances(process_pb2.EraseInstancesRequest(business_key=key))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(refused.value)
    assert info.reason == "INSTANCES_ACTIVE" and info.metadata["instance_ids"] == active.instance.id
    assert (await _rows_of(db, [done.id]))["instances"] == 1  # nothing deleted

    erased = await engine.processes.EraseInstances(
        process_pb2.EraseInstancesRequest(business_key=key, cancel_active=True)
    )
    assert (erased.instances, erased.canceled) == (2, 1) and erased.rows > 10
    assert await _tables_naming(db, key) == {}
    assert set((await _rows_of(db, [done.id, active.instance.id])).values()) == {0}
    assert (await _rows_of(db, [other.id]))["instances"] == 1
    async with db.connect() as conn:
        audit = [dict(r._mapping) for r in await conn.execute(text("SELECT * FROM erasures"))]
    assert len(audit) == 1
    assert audit[0]["id"] == erased.erasure_id and audit[0]["erased_by"] == "test-suite"
    assert (audit[0]["instances"], audit[0]["canceled"], audit[0]["rows"]) == (2, 1, erased.rows)
    assert audit[0]["selected_by"] == "business_key"


async def test_erasure_by_variable_value(engine, db):
    await deploy(engine, BUNDLE)
    mine = await _finished_triage(engine, "C-77")
    theirs = await _finished_triage(engine, "C-78")
    request = process_pb2.EraseInstancesRequest()
    request.variables.add(name="customerId").value.string_value = "C-77"
    erased = await engine.processes.EraseInstances(request)
    assert erased.instances == 1
    assert (await _rows_of(db, [mine.id]))["instances"] == 0
    assert (await _rows_of(db, [theirs.id]))["instances"] == 1
    with pytest.raises(grpc.aio.AioRpcError) as nobody:
        await engine.processes.EraseInstances(process_pb2.EraseInstancesRequest())
    assert nobody.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_erasure_larger_than_a_batch_goes_batch_by_batch_and_leaves_one_audit_row(
    engine, engine_core, db
):
    await deploy(engine, BUNDLE)

    async def waiting(customer: str) -> str:
        started = await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(
                process_id="reply", variables=struct({"ticket": f"T-{customer}", "customerId": customer})
            )
        )
        return started.instance.id

    mine = [await waiting("C-500") for _ in range(11)]
    theirs = [await waiting("C-501") for _ in range(2)]
    for instance_id in mine[:8]:
        await engine.processes.CancelInstance(
            process_pb2.CancelInstanceRequest(instance_id=instance_id, reason="ended")
        )
    # Three instances a batch: the erasure takes four batches and never more ids than that at once.
    retention = Retention(engine_core.db, batch=3)
    with pytest.raises(EngineError) as refused:
        await retention.erase("", {"customerId": "C-500"}, False, "dpo")
    assert refused.value.reason == ErrorReason.INSTANCES_ACTIVE
    assert refused.value.metadata["active"] == "3"
    assert set(refused.value.metadata["instance_ids"].split(", ")) == set(mine[8:])
    assert (await _rows_of(db, mine))["instances"] == 11  # nothing deleted

    erased = await retention.erase("", {"customerId": "C-500"}, True, "dpo")
    assert (erased.instances, erased.canceled) == (11, 3)
    assert set((await _rows_of(db, mine)).values()) == {0}
    assert (await _rows_of(db, theirs))["instances"] == 2
    async with db.connect() as conn:
        audit = [dict(r._mapping) for r in await conn.execute(text("SELECT * FROM erasures"))]
    assert len(audit) == 1
    assert (audit[0]["instances"], audit[0]["canceled"], audit[0]["rows"]) == (11, 3, erased.rows)
    assert audit[0]["selected_by"] == "variables" and audit[0]["id"] == erased.audit_id


def _sample(metrics_text: str, name: str, **labels: str) -> float:
    """A sample's value in a Prometheus text page (0 when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in metrics_text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


async def test_metrics_show_the_retention_lag_and_the_rows_a_round_deleted(
    engine, engine_core, engine_tokens, db
):
    # The session engine's own job would delete them whenever its round comes: this test runs the round.
    await engine_core.retention_rounds.stop()
    try:
        await _lag_then_deleted_rows(engine, engine_core, engine_tokens, db)
    finally:
        engine_core.retention_rounds.start()


async def _lag_then_deleted_rows(engine, engine_core, engine_tokens, db) -> None:
    await deploy(engine, BUNDLE)
    waiting = [
        await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(process_id="reply", variables=struct({"ticket": f"T-{n}"}))
        )
        for n in range(2)
    ]
    for started in waiting:
        await engine.processes.CancelInstance(
            process_pb2.CancelInstanceRequest(instance_id=started.instance.id, reason="ended")
        )
    # P7D: ended ten days ago, three days past its retention; the other one nine days ago.
    await _ended_days_ago(db, waiting[0].instance.id, 10)
    await _ended_days_ago(db, waiting[1].instance.id, 9)
    app = build_app(
        QueueStats(engine_core.db), CallerRegistry(engine_tokens.callers_file), metrics_max_age_seconds=0
    )
    server = HttpServer(app, "127.0.0.1:0")
    await server.start()
    headers = {"Authorization": f"Bearer {engine_tokens.operator}"}
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", headers=headers) as client:
            before = (await client.get("/metrics")).text
            lag = _sample(before, "abada_retention_lag_seconds")
            assert 3 * 86_400 - 60 < lag < 3 * 86_400 + 60
            await _retention_round(engine_core)
            after = (await client.get("/metrics")).text
    finally:
        await server.stop()
    assert _sample(after, "abada_retention_lag_seconds") == 0
    for table, rows in (("instances", 2), ("history", 4)):
        deleted = _sample(after, "abada_retention_rows_deleted_total", source="retention", table=table)
        deleted_before = _sample(
            before, "abada_retention_rows_deleted_total", source="retention", table=table
        )
        assert deleted - deleted_before >= rows
