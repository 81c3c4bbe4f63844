"""Multi-instance: `for_each` runs a service, user or agent node once per item of a list, each item a
task of its own, at most `max_concurrency` at once, its results collected in the list's order. A real
engine over gRPC on PostgreSQL."""

from __future__ import annotations

import asyncio
import random
import uuid
from typing import Any

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from abada_engine.runtime.flow.items import finish_item, item_end
from abada_engine.runtime.leases import hash_token
from abada_engine.store.fan_outs import ItemEnd, finish_items
from abada_engine.store.states import TaskState
from engine_helpers import (
    complete,
    deploy,
    error_info,
    fetch,
    history_types,
    instance,
    plain,
    start,
    struct,
    until_lease_ran_out,
)

LINES = """
processes:
  - id: lines
    start: price
    nodes:
      - id: price
        type: service
        topic: price-line
        for_each: "${lines}"
        as: line
        inputs: { sku: "${line.sku}", order: "${order}" }
        max_concurrency: 3
        result_variable: price
        collect: prices
        retries: 0
        next: total
      - { id: total, type: service, topic: total, next: done }
      - { id: done, type: end }
  - id: lenient
    start: price
    nodes:
      - id: price
        type: service
        topic: lenient-line
        for_each: "${lines}"
        as: line
        max_concurrency: 2
        max_items: 5
        result_variable: price
        collect: prices
        on_item_failure: skip
        retries: 0
        next: total
      - { id: total, type: service, topic: lenient-total, next: done }
      - { id: done, type: end }
  - id: review
    start: check
    nodes:
      - id: check
        type: user_task
        for_each: "${documents}"
        as: document
        result_variable: verdict
        collect: verdicts
        next: done
      - { id: done, type: end }
  - id: summarise
    start: summary
    nodes:
      - id: summary
        type: agent
        model: gemini-3.6-flash
        prompt: summarise the line
        inputs: { line: "${line}" }
        result_variable: summary
        for_each: "${lines}"
        as: line
        collect: summaries
        limits: { max_model_calls: 1, max_tool_calls: 0, max_tokens: 1000 }
        next: done
      - { id: done, type: end }
"""


def lines(count: int) -> list[dict[str, Any]]:
    return [{"sku": f"S-{index}"} for index in range(count)]


async def drain(engine: Any, topic: str, worker: str = "w") -> list[external_task_pb2.ExternalTask]:
    """Every task offered on `topic` right now (leased to `worker`)."""
    return await fetch(engine, worker, topic, max_tasks=100)


async def fail(engine: Any, task: external_task_pb2.ExternalTask, message: str) -> None:
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id, worker_id="w", lease_token=task.lease_token, error_message=message
        )
    )


async def incidents_of(engine: Any, instance_id: str) -> list[incident_pb2.Incident]:
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=instance_id))
    return list(listed.incidents)


async def test_items_run_at_most_max_concurrency_at_once_and_collect_keeps_the_list_order(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines=lines(8), order="O-1")
    shown = await instance(engine, started.id)
    [progress] = shown.fan_outs
    assert (progress.node_id, progress.items_total, progress.items_running) == ("price", 8, 3)
    done: set[str] = set()
    rng = random.Random(7)
    while len(done) < 8:
        offered = await drain(engine, "price-line")
        # Never more than max_concurrency items offered or leased at once.
        assert 0 < len(offered) <= 3
        assert await drain(engine, "price-line") == []
        rng.shuffle(offered)  # finish out of order
        for task in offered:
            item = plain(task.variables)
            assert item["order"] == "O-1"
            await complete(engine, task, "w", {"price": int(item["sku"].removeprefix("S-")) * 10})
            done.add(item["sku"])
        if len(done) < 8:
            assert await drain(engine, "total") == []
    [total] = await drain(engine, "total")
    assert plain(total.variables)["prices"] == [index * 10 for index in range(8)]
    shown = await instance(engine, started.id)
    [progress] = shown.fan_outs
    assert (progress.state, progress.items_done, progress.items_running) == ("COMPLETED", 8, 0)
    history = await history_types(engine, started.id)
    assert history.count(("FAN_OUT_STARTED", "price")) == 1
    assert history.count(("FAN_OUT_COMPLETED", "price")) == 1
    assert history.count(("TASK_COMPLETED", "price")) == 8


async def test_an_empty_list_collects_nothing_and_moves_on(engine) -> None:
    await deploy(engine, LINES)
    await start(engine, "lines", lines=[], order="O-2")
    [total] = await drain(engine, "total")
    assert plain(total.variables)["prices"] == []


async def test_a_skipped_item_is_null_in_collect_with_its_reason_in_the_history(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lenient", lines=lines(3))
    first, second = await drain(engine, "lenient-line")
    await fail(engine, second, "the supplier has no such sku")
    # The skipped item frees its place at once (max_concurrency 2): item 2 runs while item 0 still does.
    [third] = await drain(engine, "lenient-line")
    assert plain(third.variables)["line"]["sku"] == "S-2"
    await complete(engine, third, "w", {"price": 30})
    assert await drain(engine, "lenient-total") == []
    await complete(engine, first, "w", {"price": 10})
    [total] = await drain(engine, "lenient-total")
    assert plain(total.variables)["prices"] == [10, None, 30]
    events = (await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))).events
    [skipped] = [e for e in events if e.type == "ITEM_SKIPPED"]
    assert skipped.task_id == second.id
    assert plain(skipped.data)["reason"] == "the supplier has no such sku"
    assert plain(skipped.data)["item_index"] == 1
    [progress] = (await instance(engine, started.id)).fan_outs
    assert (progress.items_done, progress.items_skipped) == (3, 1)


async def test_a_slow_item_holds_its_own_place_only_and_the_others_keep_every_place_busy(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lenient", lines=lines(5), order="O-9")
    slow, quick = await drain(engine, "lenient-line")
    # Without `inputs`, an item sees the instance's variables and its item, but not the whole list.
    assert plain(slow.variables) == {"line": {"sku": "S-0"}, "order": "O-9"}
    # Items 2, 3 and 4 each take the place the previous quick one left, while item 0 runs on; never
    # more than max_concurrency (2) offered at once.
    for index in (2, 3, 4):
        await complete(engine, quick, "w", {"price": index - 1})
        [quick] = await drain(engine, "lenient-line")
        assert plain(quick.variables)["line"]["sku"] == f"S-{index}"
        [progress] = (await instance(engine, started.id)).fan_outs
        assert progress.items_running == 2
    await complete(engine, quick, "w", {"price": 4})
    assert await drain(engine, "lenient-total") == []
    await complete(engine, slow, "w", {"price": 0})
    [total] = await drain(engine, "lenient-total")
    assert plain(total.variables)["prices"] == [0, 1, 2, 3, 4]


async def test_a_failed_item_parks_in_an_incident_and_goes_on_once_retried(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines=lines(4), order="O-3")
    offered = await drain(engine, "price-line")
    assert len(offered) == 3
    by_sku = {plain(task.variables)["sku"]: task for task in offered}
    await fail(engine, by_sku["S-1"], "price service down")
    # The incident holds that item only (and its place): the others go on, item 3 in item 0's place.
    for sku in ("S-0", "S-2"):
        await complete(engine, by_sku[sku], "w", {"price": 1})
    [fourth] = await drain(engine, "price-line")
    assert plain(fourth.variables)["sku"] == "S-3"
    await complete(engine, fourth, "w", {"price": 4})
    held = await instance(engine, started.id)
    [progress] = held.fan_outs
    assert (progress.items_done, progress.items_failed, progress.state) == (3, 1, "RUNNING")
    assert await drain(engine, "total") == []
    [incident] = await incidents_of(engine, started.id)
    assert incident.node_id == "price"
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    [again] = await drain(engine, "price-line")
    assert again.id == by_sku["S-1"].id
    await complete(engine, again, "w", {"price": 0})
    [total] = await drain(engine, "total")
    assert plain(total.variables)["prices"] == [1, 0, 1, 4]


async def test_a_list_longer_than_max_items_raises_an_incident_naming_the_node(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lenient", lines=lines(6))
    [incident] = await incidents_of(engine, started.id)
    assert incident.type == "TOO_MANY_ITEMS" and incident.node_id == "price"
    assert "'price'" in incident.message and "max_items 5" in incident.message
    assert await drain(engine, "lenient-line") == []


async def test_for_each_on_something_not_a_list_raises_an_incident_naming_the_node(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines={"sku": "S-1"}, order="O-4")
    [incident] = await incidents_of(engine, started.id)
    assert incident.type == "FOR_EACH_NOT_A_LIST" and incident.node_id == "price"
    assert "'price'" in incident.message and "not a list" in incident.message


async def test_cancel_withdraws_every_item_and_refuses_a_leased_items_complete(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines=lines(10), order="O-5")
    first, *_ = await drain(engine, "price-line")
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=started.id, reason="no")
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(engine, first, "w", {"price": 1})
    assert error_info(refused.value).reason == "TASK_NOT_LEASED"
    assert await drain(engine, "price-line") == []
    shown = await instance(engine, started.id)
    [progress] = shown.fan_outs
    assert progress.state == "CANCELED" and progress.items_running == 0
    assert list(shown.active_node_ids) == []


async def test_a_user_task_fan_out_collects_each_persons_verdict(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "review", documents=["a.pdf", "b.pdf"])
    listed = await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=started.id))
    tasks = {plain(t.variables)["inputs"]["document"]: t for t in listed.user_tasks}
    assert sorted(tasks) == ["a.pdf", "b.pdf"]
    for document in ("b.pdf", "a.pdf"):
        await engine.processes.CompleteUserTask(
            process_pb2.CompleteUserTaskRequest(
                user_task_id=tasks[document].id, variables=struct({"verdict": f"ok {document}"})
            )
        )
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables)["verdicts"] == ["ok a.pdf", "ok b.pdf"]


async def test_an_agent_items_inputs_carry_its_item(engine) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "summarise", lines=["first line", "second line"])
    offered = await drain(engine, "abada:agent")
    assert sorted(plain(t.variables)["line"] for t in offered) == ["first line", "second line"]
    for task in offered:
        await complete(engine, task, "w", {"summary": plain(task.variables)["line"].upper()})
    done = await instance(engine, started.id)
    assert plain(done.variables)["summaries"] == ["FIRST LINE", "SECOND LINE"]


BAD_FOR_EACH = """
processes:
  - id: bad
    start: work
    nodes:
      - id: work
        type: service
        topic: work
        for_each: "${{items}}"
        as: item
{extra}
        next: done
      - {{ id: done, type: end }}
"""


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("        max_concurrency: 0", "processes[0].nodes[0].max_concurrency"),
        ("        collect: results", "processes[0].nodes[0].collect"),
        ("        on_item_failure: ignore", "processes[0].nodes[0].on_item_failure"),
        ("        deadline: PT1M\n        on_deadline: done", "processes[0].nodes[0].deadline"),
    ],
)
async def test_deploy_refuses_bad_for_each_fields_naming_the_field(engine, extra: str, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await deploy(engine, BAD_FOR_EACH.format(extra=extra))
    info = error_info(refused.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == field, info.metadata


async def test_deploy_refuses_for_each_on_a_node_that_cannot_fan_out(engine) -> None:
    bundle = """
processes:
  - id: bad
    start: wait
    nodes:
      - { id: wait, type: timer, duration: PT1S, for_each: "${items}", next: done }
      - { id: done, type: end }
"""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await deploy(engine, bundle)
    info = error_info(refused.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == "processes[0].nodes[0].for_each", info.metadata


async def test_the_last_items_ending_together_end_the_fan_out_exactly_once(engine) -> None:
    await deploy(engine, LINES)
    started = [await start(engine, "lines", lines=lines(9), order=f"O-{n}") for n in range(4)]
    for _ in range(20):
        offered = await drain(engine, "price-line")
        if not offered:
            break
        # Every item offered now ends at once: the last round's three race to end their fan-out.
        await asyncio.gather(*(complete(engine, task, "w", {"price": 1}) for task in offered))
    totals = await drain(engine, "total")
    assert sorted(t.instance_id for t in totals) == sorted(s.id for s in started)
    for each in started:
        history = await history_types(engine, each.id)
        assert history.count(("FAN_OUT_COMPLETED", "price")) == 1
        [progress] = (await instance(engine, each.id)).fan_outs
        assert (progress.state, progress.items_done) == ("COMPLETED", 9)


async def test_an_item_whose_worker_died_is_offered_again_alone(engine) -> None:
    await deploy(engine, LINES)
    await start(engine, "lines", lines=lines(2), order="O-6")
    first, second = await fetch(engine, "w", "price-line", max_tasks=10, lease_ms=1_000)
    await complete(engine, first, "w", {"price": 1})
    await until_lease_ran_out(second)
    # Only the item that was running comes back; the one that ended stays ended.
    [again] = await fetch(engine, "w2", "price-line", max_tasks=10)
    assert again.id == second.id and again.attempt == second.attempt + 1
    await complete(engine, again, "w2", {"price": 2})
    [total] = await drain(engine, "total")
    assert plain(total.variables)["prices"] == [1, 2]


REJECTING = """
processes:
  - id: strict
    start: summary
    nodes:
      - id: summary
        type: agent
        model: gemini-3.6-flash
        prompt: summarise the line
        result_variable: summary
        output_schema: { type: string }
        for_each: "${lines}"
        as: line
        collect: summaries
        on_item_failure: skip
        limits: { max_model_calls: 1, max_tool_calls: 0, max_tokens: 1000 }
        next: done
      - { id: done, type: end }
"""


async def test_an_agent_item_whose_answer_is_rejected_is_skipped(engine) -> None:
    await deploy(engine, REJECTING)
    started = await start(engine, "strict", lines=["a", "b"])
    offered = {plain(t.variables)["line"]: t for t in await drain(engine, "abada:agent")}
    await complete(engine, offered["a"], "w", {"summary": 42})
    await complete(engine, offered["b"], "w", {"summary": "B"})
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables)["summaries"] == [None, "B"]
    events = (await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))).events
    [skipped] = [e for e in events if e.type == "ITEM_SKIPPED"]
    assert "output_schema" in plain(skipped.data)["reason"]


async def test_a_last_item_ended_by_a_replica_that_died_before_deciding_is_ended_by_the_duty(
    engine, engine_core
) -> None:
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines=lines(1), order="O-7")
    [item] = await drain(engine, "price-line")
    # What a replica writes for the item before it dies: the item's own statement, not the decision.
    async with engine_core.db.connect() as conn:
        end = item_end(
            uuid.UUID(started.id),
            uuid.UUID(item.id),
            TaskState.COMPLETED,
            7,
            [],
            guard_worker="w",
            guard_hash=hash_token(item.lease_token),
        )
        finished = await finish_item(conn, end)
        await conn.commit()
    assert finished is not None and finished.may_be_last
    [total] = await fetch(engine, "w", "total", wait_ms=10_000)
    assert plain(total.variables)["prices"] == [7]
    assert (await history_types(engine, started.id)).count(("FAN_OUT_COMPLETED", "price")) == 1


async def test_a_cancel_racing_the_last_items_ends_cleanly(engine) -> None:
    await deploy(engine, LINES)
    for n in range(5):
        started = await start(engine, "lines", lines=lines(3), order=f"O-race-{n}")
        offered = await drain(engine, "price-line")
        assert len(offered) == 3

        async def end(task: external_task_pb2.ExternalTask) -> str:
            try:
                await complete(engine, task, "w", {"price": 1})
                return "completed"
            except grpc.aio.AioRpcError as error:
                # Withdrawn by the cancel first: refused as any withdrawn task is, nothing else.
                assert error_info(error).reason == "TASK_NOT_LEASED", error.details()
                return "refused"

        cancel = engine.processes.CancelInstance(
            process_pb2.CancelInstanceRequest(instance_id=started.id, reason="race")
        )
        outcomes = await asyncio.gather(cancel, *(end(task) for task in offered))
        shown = await instance(engine, started.id)
        assert shown.state == process_pb2.INSTANCE_STATE_CANCELED, outcomes
        assert list(shown.active_node_ids) == []
        assert shown.fan_outs[0].state in ("CANCELED", "COMPLETED")
    assert await drain(engine, "total") == []


async def test_an_item_left_pending_by_a_rolled_back_end_is_offered_by_the_next_ends(
    engine, engine_core
) -> None:
    """An end that dies before its commit (its replica or the database gone) leaves the item it was
    offering PENDING, and an end beside it, skipping that locked item, offered the next one instead.
    The ends that follow, a batch of a low item and a high one among them, still offer it."""
    await deploy(engine, LINES)
    started = await start(engine, "lines", lines=lines(7), order="O-rollback")
    instance_id = uuid.UUID(started.id)
    first, second, third = sorted(await drain(engine, "price-line"), key=lambda t: plain(t.variables)["sku"])

    def ending(task: external_task_pb2.ExternalTask) -> ItemEnd:
        return item_end(
            instance_id,
            uuid.UUID(task.id),
            TaskState.COMPLETED,
            int(plain(task.variables)["sku"].removeprefix("S-")),
            [],
            guard_worker="w",
            guard_hash=hash_token(task.lease_token),
        )

    async with engine_core.db.connect() as dying:
        await dying.begin()
        await finish_item(dying, ending(first))  # holds S-3 while it offers it
        await complete(engine, second, "w", {"price": 1})  # skips S-3, offers S-4
        await dying.rollback()
    now = await drain(engine, "price-line")
    assert [plain(t.variables)["sku"] for t in now] == ["S-4"]
    [fourth] = now
    # The first item's end comes again, in one batch with the fourth's.
    async with engine_core.db.begin() as conn:
        await finish_items(conn, [ending(first), ending(fourth)])
    offered = {plain(t.variables)["sku"]: t for t in await drain(engine, "price-line")}
    assert "S-3" in offered, sorted(offered)
    offered["S-2"] = third
    while offered:
        for task in offered.values():
            await complete(engine, task, "w", {"price": int(plain(task.variables)["sku"].removeprefix("S-"))})
        offered = {plain(t.variables)["sku"]: t for t in await drain(engine, "price-line")}
    [total] = await fetch(engine, "w", "total", wait_ms=5_000)
    assert plain(total.variables)["prices"] == [0, 1, 2, 3, 4, 5, 6]
