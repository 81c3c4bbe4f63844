"""Batch operations: retrying incidents and cancelling instances over a filter, with progress,
pause/resume, each instance's outcome, and a batch carried on by another engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import httpx2
import pytest
from abada.engine.v1 import batch_pb2, batch_pb2_grpc, external_task_pb2, incident_pb2, process_pb2
from abada_engine.core import EngineCore
from abada_engine.db.database import create_engine
from abada_engine.runtime.batches import Batches, Outcome
from abada_engine.runtime.crypto.keys import IdempotencyKeys
from abada_engine.store.batches import BatchFilter
from abada_engine.store.incidents import raise_incident
from abada_engine.store.states import BatchOutcome
from engine_helpers import complete, deploy, error_info, fetch, history_types, instance, plain, start, struct
from sqlalchemy import text

FRAGILE = """
processes:
  - id: fragile
    start: call
    nodes:
      - { id: call, type: service, topic: fragile, retries: 0, next: done }
      - { id: done, type: end }
  - id: other
    start: call
    nodes:
      - { id: call, type: service, topic: other, retries: 0, next: done }
      - { id: done, type: end }
"""


@pytest.fixture
async def batches(engine, engine_core: EngineCore) -> AsyncIterator[batch_pb2_grpc.BatchServiceStub]:
    """The batch service, with the session engine's own batch job stopped: the test works the batches
    through itself, a chunk at a time, and so knows where a pause falls."""
    await engine_core.batch_rounds.stop()
    try:
        yield batch_pb2_grpc.BatchServiceStub(engine.channel)
    finally:
        engine_core.batch_rounds.start()


async def _incidents_at(
    engine, process_id: str, topic: str, count: int, message: str = "upstream down"
) -> list[str]:
    """`count` instances of `process_id`, each held by a FAILED_TASK incident; their ids."""
    ids = [(await start(engine, process_id)).id for _ in range(count)]
    tasks = await fetch(engine, "w", topic, max_tasks=count)
    assert len(tasks) == count
    for task in tasks:
        failed = await engine.tasks.Fail(
            external_task_pb2.FailRequest(
                task_id=task.id, worker_id="w", lease_token=task.lease_token, error_message=message
            )
        )
        assert failed.incident_id
    return ids


async def _batch(batches, batch_id: str, page_size: int = 1000) -> batch_pb2.GetBatchResponse:
    return await batches.GetBatch(batch_pb2.GetBatchRequest(batch_id=batch_id, page_size=page_size))


async def test_a_retry_batch_of_100_incidents_pauses_and_resumes_and_retries_each_exactly_once(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, FRAGILE)
    ids = await _incidents_at(engine, "fragile", "fragile", 100)
    [untouched] = await _incidents_at(engine, "other", "other", 1)
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=20)

    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_RETRY_INCIDENTS,
                filter=batch_pb2.BatchFilter(process_id="fragile", incident_type="FAILED_TASK"),
            )
        )
    ).batch
    assert (created.state, created.total, created.pending, created.created_by) == (
        batch_pb2.BATCH_STATE_RUNNING,
        100,
        100,
        "test-suite",
    )
    assert await job.step() == 20
    assert await job.step() == 20
    paused = (await batches.PauseBatch(batch_pb2.PauseBatchRequest(batch_id=created.id))).batch
    assert paused.state == batch_pb2.BATCH_STATE_PAUSED

    # Paused: nothing is claimed, and the progress so far is there to read.
    assert await job.step() == 0
    shown = await _batch(batches, created.id)
    assert (shown.batch.state, shown.batch.done, shown.batch.pending) == (
        batch_pb2.BATCH_STATE_PAUSED,
        40,
        60,
    )
    outcomes = [i.outcome for i in shown.items]
    assert outcomes.count(batch_pb2.BATCH_OUTCOME_DONE) == 40
    assert outcomes.count(batch_pb2.BATCH_OUTCOME_PENDING) == 60
    open_now = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())
    assert len(open_now.incidents) == 61  # 60 still held, and the other process's

    await batches.ResumeBatch(batch_pb2.ResumeBatchRequest(batch_id=created.id))
    while await job.step():
        pass
    finished = await _batch(batches, created.id)
    assert (finished.batch.state, finished.batch.done, finished.batch.pending) == (
        batch_pb2.BATCH_STATE_COMPLETED,
        100,
        0,
    )
    assert {i.instance_id for i in finished.items} == set(ids)
    assert {i.message for i in finished.items} == {"1 incident(s) retried"}
    # Each task is offered once more, on its second attempt: retried exactly once.
    tasks = await fetch(engine, "w", "fragile", max_tasks=200)
    assert sorted(t.instance_id for t in tasks) == sorted(ids)
    assert {t.attempt for t in tasks} == {2}
    resolved = [t for t, _ in await history_types(engine, ids[0]) if t == "INCIDENT_RESOLVED"]
    assert len(resolved) == 1
    # The other process's incident is left open.
    [left] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    assert left.instance_id == untouched

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await batches.PauseBatch(batch_pb2.PauseBatchRequest(batch_id=created.id))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(refused.value).reason == "BATCH_FINISHED"


async def test_a_cancel_batch_takes_what_its_filter_matches_and_records_each_outcome(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, FRAGILE)
    matching = [(await start(engine, "fragile")).id for _ in range(5)]
    # Another process, and an instance that ended before the batch: neither is taken.
    other = (await start(engine, "other")).id
    [first_task] = await fetch(engine, "w", "fragile")
    await complete(engine, first_task, "w", {})
    ended = first_task.instance_id
    matching.remove(ended)
    # A second version: the filter names version 1 only.
    await deploy(engine, FRAGILE.replace("topic: fragile, retries: 0", "topic: fragile, retries: 1"))
    newer = (await start(engine, "fragile")).id
    assert (await instance(engine, newer)).version == 2

    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_CANCEL,
                filter=batch_pb2.BatchFilter(process_id="fragile", version=1, node_id="call"),
                reason="bad prompt release",
            )
        )
    ).batch
    assert created.total == 4
    # One of them is cancelled by hand before the job gets to it: skipped, saying why.
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=matching[0], reason="by hand")
    )
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog)
    assert await job.step() == 4

    shown = await _batch(batches, created.id)
    assert (shown.batch.state, shown.batch.done, shown.batch.skipped, shown.batch.failed) == (
        batch_pb2.BATCH_STATE_COMPLETED,
        3,
        1,
        0,
    )
    by_instance = {i.instance_id: i for i in shown.items}
    assert set(by_instance) == set(matching)
    assert by_instance[matching[0]].outcome == batch_pb2.BATCH_OUTCOME_SKIPPED
    assert "canceled" in by_instance[matching[0]].message
    for instance_id in matching[1:]:
        assert by_instance[instance_id].outcome == batch_pb2.BATCH_OUTCOME_DONE
        assert (await instance(engine, instance_id)).state == process_pb2.INSTANCE_STATE_CANCELED
        assert ("INSTANCE_CANCELED", "") in await history_types(engine, instance_id)
    assert (await instance(engine, other)).state == process_pb2.INSTANCE_STATE_ACTIVE
    assert (await instance(engine, newer)).state == process_pb2.INSTANCE_STATE_ACTIVE
    assert (await instance(engine, ended)).state == process_pb2.INSTANCE_STATE_COMPLETED
    # Only the outcomes asked for.
    skipped = await batches.GetBatch(
        batch_pb2.GetBatchRequest(batch_id=created.id, outcome=batch_pb2.BATCH_OUTCOME_SKIPPED)
    )
    assert [i.instance_id for i in skipped.items] == [matching[0]]
    listed = await batches.ListBatches(batch_pb2.ListBatchesRequest())
    assert [b.id for b in listed.batches] == [created.id]

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_CANCEL, filter=batch_pb2.BatchFilter(process_id="fragile")
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_canceled_batch_leaves_its_pending_instances_alone(engine, engine_core: EngineCore, batches):
    await deploy(engine, FRAGILE)
    ids = [(await start(engine, "fragile")).id for _ in range(6)]
    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_CANCEL,
                filter=batch_pb2.BatchFilter(process_id="fragile"),
                reason="cleanup",
            )
        )
    ).batch
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=2)
    assert await job.step() == 2
    canceled = (await batches.CancelBatch(batch_pb2.CancelBatchRequest(batch_id=created.id))).batch
    assert (canceled.state, canceled.done, canceled.pending) == (batch_pb2.BATCH_STATE_CANCELED, 2, 4)
    assert await job.step() == 0
    states = [(await instance(engine, i)).state for i in ids]
    assert states.count(process_pb2.INSTANCE_STATE_CANCELED) == 2
    assert states.count(process_pb2.INSTANCE_STATE_ACTIVE) == 4


async def test_a_batch_is_carried_on_by_another_engine_on_the_same_database(
    engine, engine_core: EngineCore, batches, db, database_url
):
    await deploy(engine, FRAGILE)
    ids = await _incidents_at(engine, "fragile", "fragile", 30)
    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_RETRY_INCIDENTS,
                filter=batch_pb2.BatchFilter(process_id="fragile", incident_message="upstream"),
            )
        )
    ).batch
    # This engine works a first chunk, then stops (its job is stopped by the fixture).
    assert await Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=10).step() == 10

    # Another engine on the same database picks the batch up with its own periodic job.
    pool = create_engine(database_url, pool_size=4)
    other = await EngineCore.open(
        pool,
        database_url,
        engine_core.journal.sealer._keys,  # the suite's journal keys: replicas share them
        IdempotencyKeys(b"test-idempotency-secret"),
        None,
        batch_round_seconds=0.1,
        retention_round_seconds=0,
    )
    try:
        for _ in range(100):
            shown = await _batch(batches, created.id)
            if shown.batch.state == batch_pb2.BATCH_STATE_COMPLETED:
                break
            await asyncio.sleep(0.1)
    finally:
        await other.close()
        await pool.dispose()
    assert (shown.batch.state, shown.batch.done) == (batch_pb2.BATCH_STATE_COMPLETED, 30)
    async with db.connect() as conn:
        retried = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM history WHERE type = 'INCIDENT_RESOLVED' AND instance_id = ANY(:ids)"
                ),
                {"ids": [uuid.UUID(i) for i in ids]},
            )
        ).scalar_one()
    assert retried == 30


async def test_batches_over_http_are_the_operators(engine, engine_http, engine_tokens, batches):
    await deploy(engine, FRAGILE)
    started = (await start(engine, "fragile")).id
    headers = {"Authorization": f"Bearer {engine_tokens.operator}"}
    async with httpx2.AsyncClient(base_url=engine_http, headers=headers, timeout=20) as client:
        created = await client.post(
            "/v1/batches",
            json={"kind": "CANCEL", "filter": {"processId": "fragile"}, "reason": "over http"},
        )
        assert created.status_code == 200, created.text
        batch = created.json()["batch"]
        assert (batch["total"], batch["createdBy"], batch["state"]) == ("1", "ops", "BATCH_STATE_RUNNING")
        paused = await client.post(f"/v1/batches/{batch['id']}:pause", json={})
        assert paused.json()["batch"]["state"] == "BATCH_STATE_PAUSED", paused.text
        shown = await client.get(f"/v1/batches/{batch['id']}")
        assert [i["instanceId"] for i in shown.json()["items"]] == [started]
        listed = await client.get("/v1/batches")
        assert [b["id"] for b in listed.json()["batches"]] == [batch["id"]]
    async with httpx2.AsyncClient(
        base_url=engine_http, headers={"Authorization": f"Bearer {engine_tokens.worker_pool}"}, timeout=20
    ) as worker:
        refused = await worker.get("/v1/batches")
        assert refused.status_code == 403


async def test_an_instance_the_operation_refuses_is_failed_with_why_and_the_rest_go_on(
    engine, engine_core: EngineCore, batches, db
):
    await deploy(engine, FRAGILE)
    [ordinary] = await _incidents_at(engine, "fragile", "fragile", 1)
    unknown = (await start(engine, "fragile")).id
    # An outcome-unknown write asks a person what happened: a retry never applies to it.
    async with db.begin() as conn:
        await raise_incident(
            conn,
            instance_id=uuid.UUID(unknown),
            node_id="call",
            type_="TOOL_OUTCOME_UNKNOWN",
            message="the write's outcome is unknown",
        )
    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_RETRY_INCIDENTS, filter=batch_pb2.BatchFilter(process_id="fragile")
            )
        )
    ).batch
    assert created.total == 2
    assert await Batches(engine_core.db, engine_core.incidents, engine_core.catalog).step() == 2
    shown = await _batch(batches, created.id)
    assert (shown.batch.done, shown.batch.failed, shown.batch.state) == (
        1,
        1,
        batch_pb2.BATCH_STATE_COMPLETED,
    )
    by_instance = {i.instance_id: i for i in shown.items}
    assert by_instance[ordinary].outcome == batch_pb2.BATCH_OUTCOME_DONE
    assert by_instance[unknown].outcome == batch_pb2.BATCH_OUTCOME_FAILED
    assert by_instance[unknown].message.startswith("RESOLUTION_NOT_APPLICABLE")
    [still_open] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    assert still_open.instance_id == unknown


async def test_a_fault_on_one_instance_fails_it_alone_and_the_batch_goes_on(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, FRAGILE)
    ids = sorted([(await start(engine, "fragile")).id for _ in range(3)])
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog)
    touched: list[str] = []

    async def faulty(conn, item):
        if str(item.instance_id) == ids[0]:
            raise RuntimeError("a bug")
        if str(item.instance_id) == ids[1]:
            await conn.execute(text("SELECT 1 / 0"))
        await conn.execute(text("SELECT 1"))
        touched.append(str(item.instance_id))
        return Outcome(BatchOutcome.DONE, "fine")

    job.register("FAULTY", faulty)
    created = await job.create("FAULTY", BatchFilter(process_id="fragile"), "", "test")
    assert await job.step() == 3
    shown = await _batch(batches, str(created.row.id))
    outcomes = {i.instance_id: (i.outcome, i.message) for i in shown.items}
    assert outcomes[ids[0]] == (batch_pb2.BATCH_OUTCOME_FAILED, "internal error: RuntimeError")
    assert outcomes[ids[1]][0] == batch_pb2.BATCH_OUTCOME_FAILED
    assert outcomes[ids[1]][1].startswith("the database refused it")
    assert outcomes[ids[2]] == (batch_pb2.BATCH_OUTCOME_DONE, "fine")
    assert touched == [ids[2]] and shown.batch.state == batch_pb2.BATCH_STATE_COMPLETED


async def test_replicas_working_one_batch_at_once_never_take_the_same_instance(
    engine, engine_core: EngineCore, batches, db
):
    await deploy(engine, FRAGILE)
    ids = await _incidents_at(engine, "fragile", "fragile", 40)
    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_RETRY_INCIDENTS, filter=batch_pb2.BatchFilter(process_id="fragile")
            )
        )
    ).batch
    # Four jobs claim side by side, as four replicas would: each takes instances the others do not hold.
    jobs = [Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=10) for _ in range(4)]
    claimed = await asyncio.gather(*(job.step() for job in jobs))
    assert sum(claimed) == 40 and max(claimed) == 10
    while any(await asyncio.gather(*(job.step() for job in jobs))):
        pass
    shown = await _batch(batches, created.id)
    assert (shown.batch.state, shown.batch.done) == (batch_pb2.BATCH_STATE_COMPLETED, 40)
    async with db.connect() as conn:
        resolved = (
            await conn.execute(
                text(
                    "SELECT instance_id, count(*) FROM history WHERE type = 'INCIDENT_RESOLVED' "
                    "AND instance_id = ANY(:ids) GROUP BY instance_id"
                ),
                {"ids": [uuid.UUID(i) for i in ids]},
            )
        ).all()
    assert len(resolved) == 40 and {count for _, count in resolved} == {1}


async def test_a_cancel_batch_beside_workers_completing_the_same_instances(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, FRAGILE)
    ids = [(await start(engine, "fragile")).id for _ in range(30)]
    tasks = await fetch(engine, "w", "fragile", max_tasks=30)
    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_CANCEL,
                filter=batch_pb2.BatchFilter(process_id="fragile"),
                reason="race",
            )
        )
    ).batch
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=5)

    async def work_through() -> None:
        while await job.step():  # each chunk's statements let the completions in between
            pass

    async def complete_all() -> int:
        completed = 0
        for task in tasks:
            try:
                await complete(engine, task, "w", {})
                completed += 1
            except grpc.aio.AioRpcError:
                pass  # the batch cancelled this instance first: its task was withdrawn
        return completed

    _, completed = await asyncio.gather(work_through(), complete_all())
    shown = await _batch(batches, created.id)
    outcomes = {i.instance_id: i.outcome for i in shown.items}
    # Whoever came first won, whole: a completed instance was skipped, a cancelled one is the batch's.
    for instance_id in ids:
        state = (await instance(engine, instance_id)).state
        expected = {
            process_pb2.INSTANCE_STATE_COMPLETED: batch_pb2.BATCH_OUTCOME_SKIPPED,
            process_pb2.INSTANCE_STATE_CANCELED: batch_pb2.BATCH_OUTCOME_DONE,
        }[state]
        assert outcomes[instance_id] == expected
    assert shown.batch.skipped == completed and shown.batch.done == 30 - completed


def _review_flow(review_node: str) -> str:
    """A service call followed by a review; version 2 renames or drops the review node."""
    review = f"- {{ id: {review_node}, type: user_task, next: done }}" if review_node else ""
    follows = review_node or "done"
    return f"""
processes:
  - id: reviewed
    start: call
    nodes:
      - {{ id: call, type: service, topic: reviewed-call, retries: 0, next: {follows} }}
      {review}
      - {{ id: done, type: end }}
"""


async def test_a_migrate_batch_moves_twenty_instances_and_refuses_the_one_at_an_unmapped_node(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, _review_flow("review"))
    ids = [(await start(engine, "reviewed")).id for _ in range(20)]
    # One instance has gone on to the review, a node version 2 no longer has.
    [ahead] = await fetch(engine, "w", "reviewed-call")
    await complete(engine, ahead, "w", {})
    await deploy(engine, _review_flow(""))

    # A plan naming a node version 1 lacks, or a version that does not exist, is refused whole.
    unknown_node = batch_pb2.BatchMigration(
        to_version=2, mappings=[process_pb2.NodeMapping(from_node_id="nope", to_node_id="call")]
    )
    for which, migration, code in (
        (1, unknown_node, grpc.StatusCode.INVALID_ARGUMENT),
        (1, batch_pb2.BatchMigration(to_version=7), grpc.StatusCode.NOT_FOUND),
        (0, batch_pb2.BatchMigration(to_version=2), grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await batches.CreateBatch(
                batch_pb2.CreateBatchRequest(
                    kind=batch_pb2.BATCH_KIND_MIGRATE,
                    filter=batch_pb2.BatchFilter(process_id="reviewed", version=which),
                    migration=migration,
                )
            )
        assert refused.value.code() == code
    assert "name the version the instances leave" in refused.value.details()
    assert (await batches.ListBatches(batch_pb2.ListBatchesRequest())).batches == []

    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_MIGRATE,
                filter=batch_pb2.BatchFilter(process_id="reviewed", version=1),
                migration=batch_pb2.BatchMigration(to_version=2),
            )
        )
    ).batch
    assert (created.kind, created.total, created.migration.to_version) == (
        batch_pb2.BATCH_KIND_MIGRATE,
        20,
        2,
    )
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog, chunk=8)
    while await job.step():
        pass

    shown = await _batch(batches, created.id)
    assert (shown.batch.state, shown.batch.done, shown.batch.failed, shown.batch.skipped) == (
        batch_pb2.BATCH_STATE_COMPLETED,
        19,
        1,
        0,
    )
    by_instance = {i.instance_id: i for i in shown.items}
    refused_item = by_instance[ahead.instance_id]
    assert refused_item.outcome == batch_pb2.BATCH_OUTCOME_FAILED
    assert refused_item.message.startswith("MIGRATION_PLAN_INVALID") and "'review'" in refused_item.message
    assert (await instance(engine, ahead.instance_id)).version == 1
    for instance_id in ids:
        if instance_id == ahead.instance_id:
            continue
        assert by_instance[instance_id].outcome == batch_pb2.BATCH_OUTCOME_DONE
        assert (await instance(engine, instance_id)).version == 2
        assert ("INSTANCE_MIGRATED", "") in await history_types(engine, instance_id)
    # The migrated ones go on under version 2: their call now leads straight to the end.
    tasks = await fetch(engine, "w", "reviewed-call", max_tasks=50)
    assert len(tasks) == 19
    await complete(engine, tasks[0], "w", {})
    assert (await instance(engine, tasks[0].instance_id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_a_modify_batch_sets_a_variable_on_every_instance_of_one_business_key(
    engine, engine_core: EngineCore, batches
):
    await deploy(engine, FRAGILE)

    async def started(business_key: str) -> str:
        response = await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(
                process_id="fragile", business_key=business_key, variables=struct({"tier": "basic"})
            )
        )
        return response.instance.id

    customer = [await started("customer-7") for _ in range(4)]
    others = [await started("customer-8") for _ in range(2)]

    with pytest.raises(grpc.aio.AioRpcError) as no_reason:
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_MODIFY,
                filter=batch_pb2.BatchFilter(process_id="fragile", business_key="customer-7"),
                modification=batch_pb2.BatchModification(set_variables=struct({"tier": "gold"})),
            )
        )
    assert no_reason.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    created = (
        await batches.CreateBatch(
            batch_pb2.CreateBatchRequest(
                kind=batch_pb2.BATCH_KIND_MODIFY,
                filter=batch_pb2.BatchFilter(process_id="fragile", business_key="customer-7"),
                reason="upgraded by support",
                modification=batch_pb2.BatchModification(
                    set_variables=struct({"tier": "gold"}), unset_variables=["missing"]
                ),
            )
        )
    ).batch
    assert created.total == 4
    assert plain(created.modification.set_variables) == {"tier": "gold"}
    job = Batches(engine_core.db, engine_core.incidents, engine_core.catalog)
    assert await job.step() == 4

    shown = await _batch(batches, created.id)
    assert (shown.batch.state, shown.batch.done) == (batch_pb2.BATCH_STATE_COMPLETED, 4)
    assert {i.instance_id for i in shown.items} == set(customer)
    for instance_id in customer:
        assert plain((await instance(engine, instance_id)).variables)["tier"] == "gold"
        history = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id))
        [entry] = [e for e in history.events if e.type == "VARIABLE_SET"]
        assert plain(entry.data) == {
            "name": "tier",
            "value": "gold",
            "by": "test-suite",
            "reason": "upgraded by support",
        }
    for instance_id in others:
        assert plain((await instance(engine, instance_id)).variables)["tier"] == "basic"
