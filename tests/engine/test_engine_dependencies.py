"""Dependencies' circuits through the engine's API: a worker reports a model down, the engine makes
it the probe or parks the task, holds other tasks back at fetch and at their model call, sends one
probe at a time, and offers every parked task again once a call gets through."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import grpc
import pytest
from abada.engine.v1 import (
    dependency_pb2,
    dependency_pb2_grpc,
    external_task_pb2,
    incident_pb2,
    process_pb2,
    queue_pb2,
    queue_pb2_grpc,
)
from abada_engine.store import dependencies as circuit_store
from abada_engine.store import tasks as task_store
from engine_helpers import (
    ONE_AGENT_TASK,
    append,
    deploy,
    error_info,
    fetch,
    history_types,
    leased,
    start,
)
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sqlalchemy import text

AGENT = "abada:agent"
MODEL = dependency_pb2.Dependency(kind=dependency_pb2.DEPENDENCY_KIND_MODEL, name="gemini-3.6-flash")
CRM = dependency_pb2.Dependency(kind=dependency_pb2.DEPENDENCY_KIND_TOOL_SERVER, name="crm")
WAIT = external_task_pb2.DEPENDENCY_ACTION_WAIT
PARKED = external_task_pb2.DEPENDENCY_ACTION_PARKED


async def report(
    engine: Any,
    task: external_task_pb2.ExternalTask,
    *,
    up: bool = False,
    dependency: dependency_pb2.Dependency = MODEL,
    worker_id: str = "w",
    **fields: Any,
) -> external_task_pb2.ReportDependencyResponse:
    return await engine.tasks.ReportDependency(
        external_task_pb2.ReportDependencyRequest(
            task_id=task.id,
            worker_id=worker_id,
            lease_token=task.lease_token,
            dependency=dependency,
            up=up,
            error_message="" if up else "Gemini answered 503 UNAVAILABLE: overloaded",
            wait_in_place=fields.pop("wait_in_place", True),
            **fields,
        )
    )


async def circuits(engine: Any) -> list[dependency_pb2.DependencyStatus]:
    stub = dependency_pb2_grpc.DependencyServiceStub(engine.channel)
    return list((await stub.ListDependencies(dependency_pb2.ListDependenciesRequest())).dependencies)


async def topic(engine: Any) -> queue_pb2.TopicStats:
    stub = queue_pb2_grpc.QueueServiceStub(engine.channel)
    (found,) = [t for t in (await stub.ListTopics(queue_pb2.ListTopicsRequest())).topics if t.name == AGENT]
    return found


async def test_the_first_failure_opens_the_circuit_and_its_task_probes_in_place(engine) -> None:
    first, second = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 2)

    probing = await report(engine, first)
    parked = await report(engine, second)

    assert probing.action == WAIT and probing.probe
    wait = probing.retry_time.ToDatetime() - probing.retry_time.ToDatetime().replace(microsecond=0)
    assert wait.total_seconds() < 1
    assert parked.action == PARKED and not parked.probe
    (status,) = await circuits(engine)
    assert status.dependency == MODEL and status.state == dependency_pb2.DEPENDENCY_STATE_DOWN
    assert status.probe_task_id == first.id and status.held_tasks == 1
    assert "503" in status.last_error
    # The parked task holds no lease: it is neither ready nor leased, so no autoscaler counts it.
    stats = await topic(engine)
    assert (stats.parked, stats.leased, stats.demand) == (1, 1, 1)
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await report(engine, second)
    assert error_info(gone.value).reason == "NOT_LEASE_HOLDER", "the parked task has no lease left"
    assert ("TASK_PARKED", "agent") in await history_types(engine, second.instance_id)


async def test_a_model_call_would_reach_a_dependency_that_is_down_is_refused_unless_it_probes(engine) -> None:
    first, second = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 2)
    await report(engine, first)
    await asyncio.sleep(0.2)  # the engine hears of its own circuit change

    with pytest.raises(grpc.aio.AioRpcError) as held:
        await append(engine, second, 1, "MODEL_CALL", "STARTED")
    probe = await append(engine, first, 1, "MODEL_CALL", "STARTED")

    assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(held.value)
    assert info.reason == "DEPENDENCY_UNAVAILABLE" and info.metadata["dependency"] == "model:gemini-3.6-flash"
    status = rpc_status.from_call(held.value)
    assert status is not None
    assert any(detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for detail in status.details)
    assert probe.step.sequence == 1
    # Told so, the worker reports the refusal: no failure of the model, the task is parked.
    answer = await report(engine, second, not_called=True)
    assert answer.action == PARKED
    (status_now,) = await circuits(engine)
    assert status_now.failed_probes == 0


async def test_a_fetch_parks_the_tasks_a_down_dependency_holds_without_spending_an_attempt(engine) -> None:
    (first,) = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 1)
    await report(engine, first, retry_after_ms=60_000)  # asked to wait a minute: parked too
    later = await start(engine, "think")
    await asyncio.sleep(0.2)

    assert await fetch(engine, "w", AGENT) == []

    stub = queue_pb2_grpc.QueueServiceStub(engine.channel)
    listed = (await stub.ListTasks(queue_pb2.ListTasksRequest(instance_id=later.id))).tasks
    assert [(t.state, t.parked_on, t.attempt) for t in listed] == [("PARKED", "model:gemini-3.6-flash", 0)]
    (status,) = await circuits(engine)
    assert status.held_tasks == 2 and status.probe_task_id == ""


async def test_the_probe_round_sends_one_parked_task_and_a_call_that_gets_through_frees_them_all(
    engine, engine_core
) -> None:
    await deploy(engine, ONE_AGENT_TASK)
    for _ in range(3):
        await start(engine, "think")
    tasks = await fetch(engine, "w", AGENT, max_tasks=3)
    await report(engine, tasks[0], retry_after_ms=6_000)
    for task in tasks[1:]:
        await report(engine, task)
    assert (await circuits(engine))[0].held_tasks == 3

    await engine_core.dependencies.probe_round()  # not due yet: nothing goes out
    assert await fetch(engine, "w", AGENT) == []
    async with engine_core.db.begin() as conn:
        await conn.execute(text("UPDATE dependencies SET next_probe_at = now()"))
    await engine_core.dependencies.probe_round()

    (probe,) = await fetch(engine, "w", AGENT, max_tasks=3)
    assert list(probe.probes) == [MODEL]
    assert probe.attempt == 2  # its second lease: the park gave back no attempt it had used
    (status,) = await circuits(engine)
    assert status.state == dependency_pb2.DEPENDENCY_STATE_PROBING and status.probe_task_id == probe.id

    answered = await report(engine, probe, up=True)

    assert answered.action == external_task_pb2.DEPENDENCY_ACTION_CONTINUE
    (status,) = await circuits(engine)
    assert status.state == dependency_pb2.DEPENDENCY_STATE_UP and status.held_tasks == 0
    rest = await fetch(engine, "w", AGENT, max_tasks=3)
    assert len(rest) == 2 and not any(t.probes for t in rest)
    assert ("DEPENDENCY_UP", "agent") in await history_types(engine, probe.instance_id)


async def test_a_probe_waiting_in_place_is_the_only_probe_past_its_probe_time(engine, engine_core) -> None:
    first, second = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 2)
    await report(engine, first)  # waits in place as the probe, its lease kept
    await report(engine, second)
    async with engine_core.db.begin() as conn:
        await conn.execute(text("UPDATE dependencies SET next_probe_at = now()"))

    await engine_core.dependencies.probe_round()

    assert await fetch(engine, "w", AGENT) == [], "a second probe went out beside the one waiting in place"
    (status,) = await circuits(engine)
    assert status.probe_task_id == first.id and status.held_tasks == 1
    # Its instance canceled, the probe is no longer out: the next one goes.
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=first.instance_id, reason="by hand")
    )
    await engine_core.dependencies.probe_round()
    (probe,) = await fetch(engine, "w", AGENT)
    assert probe.id == second.id and list(probe.probes) == [MODEL]


async def test_a_fetch_never_parks_a_task_behind_a_circuit_closing_beside_it(engine, engine_core) -> None:
    """A fetch holding tasks back reads the circuit while the call that got through is closing it and
    offering its parked tasks again: the fetch waits for that to commit and parks nothing, or parks
    first and sees them offered. A task parked after the offer would wait for a circuit that is UP."""
    first, second = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 2)
    await report(engine, first)  # the circuit is DOWN, `first` its probe
    key = "model:gemini-3.6-flash"
    async with engine_core.db.connect() as closing:
        await closing.begin()
        await circuit_store.lock(closing, key, "model", "gemini-3.6-flash")
        await circuit_store.close_circuit(closing, key)
        assert await task_store.release_parked(closing, key) == 0
        # The fetch's hold-back, on its own connection, while the close is not yet committed.
        async with engine_core.db.connect() as fetching:
            held = asyncio.create_task(
                task_store.hold_for_dependencies(fetching, [uuid.UUID(second.id)], [key], [60_000])
            )
            await asyncio.sleep(0.3)
            await closing.commit()
            assert await held == {}
    stub = queue_pb2_grpc.QueueServiceStub(engine.channel)
    listed = (await stub.ListTasks(queue_pb2.ListTasksRequest(instance_id=second.instance_id))).tasks
    assert [t.state for t in listed] == ["LEASED"]


async def test_past_the_outage_budget_a_report_raises_one_incident(engine) -> None:
    bundle = ONE_AGENT_TASK.replace("next: done", "outage_budget: PT1S\n        next: done")
    (task,) = await leased(engine, bundle, "think", AGENT, 1)
    first = await report(engine, task)
    await asyncio.sleep(1.2)

    spent = await report(engine, task)

    assert first.action == WAIT
    assert spent.action == external_task_pb2.DEPENDENCY_ACTION_INCIDENT_RAISED
    (incident,) = (
        await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=task.instance_id))
    ).incidents
    assert incident.id == spent.incident_id and incident.type == "DEPENDENCY_UNAVAILABLE"
    assert "model 'gemini-3.6-flash' has been unavailable" in incident.message
    assert incident.details["dependency"] == "model:gemini-3.6-flash"


async def test_parked_tasks_past_their_budget_each_raise_one_incident(engine, engine_core) -> None:
    bundle = ONE_AGENT_TASK.replace("next: done", "outage_budget: PT1S\n        next: done")
    tasks = await leased(engine, bundle, "think", AGENT, 3)
    for task in tasks:
        await report(engine, task, retry_after_ms=60_000)
    await asyncio.sleep(1.2)

    await engine_core.dependencies.budget_round()
    await engine_core.dependencies.budget_round()

    listed = (
        await engine.incidents.ListIncidents(
            incident_pb2.ListIncidentsRequest(type="DEPENDENCY_UNAVAILABLE", dependency=MODEL)
        )
    ).incidents
    assert sorted(i.task_id for i in listed) == sorted(t.id for t in tasks)


async def test_a_report_is_refused_for_a_dependency_the_task_does_not_have_or_without_the_lease(
    engine,
) -> None:
    (task,) = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 1)

    with pytest.raises(grpc.aio.AioRpcError) as unbound:
        await report(engine, task, dependency=CRM)
    with pytest.raises(grpc.aio.AioRpcError) as stranger:
        await engine.tasks.ReportDependency(
            external_task_pb2.ReportDependencyRequest(
                task_id=task.id, worker_id="w", lease_token="forged", dependency=MODEL
            )
        )
    with pytest.raises(grpc.aio.AioRpcError) as unnamed:
        await report(engine, task, dependency=dependency_pb2.Dependency(name="gemini-3.6-flash"))

    assert error_info(unbound.value).reason == "DEPENDENCY_NOT_BOUND"
    assert error_info(stranger.value).reason == "NOT_LEASE_HOLDER"
    assert unnamed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await circuits(engine) == [], "a refused report changed no circuit"


async def test_a_report_that_cannot_wait_in_place_parks_even_the_probe(engine) -> None:
    (task,) = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 1)

    answer = await report(engine, task, wait_in_place=False)

    assert answer.action == PARKED
    (status,) = await circuits(engine)
    assert status.held_tasks == 1 and status.probe_task_id == ""


async def test_an_outage_budget_that_is_no_duration_is_refused_at_deploy(engine) -> None:
    bad = ONE_AGENT_TASK.replace("next: done", "outage_budget: half an hour\n        next: done")

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await deploy(engine, bad)

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outage_budget" in refused.value.details() and "ISO-8601" in refused.value.details()
