"""A `for_each` agent node's max_cost_usd is one budget for all its items together.

The engine refuses the model call that would pass it, whichever item makes it; items beginning calls at
the same moment are weighed one after the other; the first item stopped raises the fan-out's one
LIMIT_EXCEEDED incident and the others stop beside it, without incidents of their own; a RETRY of that
incident puts them all back in the queue. Real engine over gRPC on PostgreSQL; the tests play the
agent workers' journal calls themselves, so each call's cost is exact.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2
from engine_helpers import append, deploy, error_info, fetch, history_types, journal, start, struct

TOPIC = "abada:agent"
# $0.10 an input token: a call journaling (2, 0) tokens costs $0.20.
CALL_TOKENS = (2, 0)


def bundle(items_at_once: int, budget: str = "max_cost_usd: 0.5") -> str:
    return f"""
models:
  - {{ name: priced-model, provider: gemini, price: {{ input_per_million_usd: 100000, output_per_million_usd: 0 }} }}
processes:
  - id: invoice
    start: triage
    nodes:
      - id: triage
        type: agent
        model: priced-model
        prompt: Triage this line.
        for_each: ${{lines}}
        as: line
        inputs: {{ line: "${{line}}" }}
        max_concurrency: {items_at_once}
        result_variable: verdict
        collect: verdicts
        limits: {{ max_model_calls: 10, {budget} }}
        next: done
      - {{ id: done, type: end }}
"""


async def started(engine: Any, task: external_task_pb2.ExternalTask, sequence: int) -> Any:
    return await append(engine, task, sequence, "MODEL_CALL", "STARTED", request={"turn": sequence})


async def finished(engine: Any, task: external_task_pb2.ExternalTask, sequence: int) -> Any:
    return await append(
        engine, task, sequence, "MODEL_CALL", "COMPLETED", response={"text": "ok"}, tokens=CALL_TOKENS
    )


async def open_incidents(engine: Any, instance_id: str) -> list[incident_pb2.Incident]:
    listed = await engine.incidents.ListIncidents(
        incident_pb2.ListIncidentsRequest(instance_id=instance_id, state=incident_pb2.INCIDENT_STATE_OPEN)
    )
    return list(listed.incidents)


async def spent(engine: Any, tasks: list[external_task_pb2.ExternalTask]) -> float:
    total = 0.0
    for task in tasks:
        total += sum(step.cost_usd for step in await journal(engine, task.id))
    return total


async def fan_out_of(
    engine: Any, lines: int, items_at_once: int
) -> tuple[str, list[external_task_pb2.ExternalTask]]:
    await deploy(engine, bundle(items_at_once))
    begun = await start(engine, "invoice", lines=[f"line {n}" for n in range(lines)])
    items = await fetch(engine, "w", TOPIC, max_tasks=lines)
    assert len(items) == items_at_once
    return begun.id, items


def refused_for_the_shared_budget(error: grpc.aio.AioRpcError) -> bool:
    info = error_info(error)
    return (
        error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and info.reason == "LIMIT_EXCEEDED"
        and (info.metadata["limit"], info.metadata["scope"]) == ("max_cost_usd", "fan_out")
    )


async def test_the_call_that_would_pass_the_nodes_budget_is_refused_whichever_item_makes_it(engine) -> None:
    instance_id, (first, second, third) = await fan_out_of(engine, lines=6, items_at_once=3)
    await started(engine, first, 1)
    await finished(engine, first, 1)  # $0.20 spent
    await started(engine, second, 1)  # $0.20 spent + this one (about $0.20): under $0.50

    # A third item's call: $0.20 spent, one call in flight and this one would pass $0.50.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(engine, third, 1)
    assert refused_for_the_shared_budget(caught.value)
    assert "shared by all items" in caught.value.details()
    assert "1 call(s) in flight" in caught.value.details()

    await finished(engine, second, 1)  # $0.40 spent
    # The first item's next call: refused as well, and it stops beside the third without an incident.
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await started(engine, first, 2)
    assert refused_for_the_shared_budget(again.value)
    assert error_info(again.value).metadata["spent_usd"] == "0.400000"

    (incident,) = await open_incidents(engine, instance_id)
    assert (incident.type, incident.node_id, incident.task_id) == ("LIMIT_EXCEEDED", "triage", third.id)
    history = await history_types(engine, instance_id)
    assert history.count(("INCIDENT_RAISED", "triage")) == 1
    assert history.count(("ITEM_STOPPED", "triage")) == 1
    # The budget was never passed: what the items journaled cost $0.40.
    assert await spent(engine, [first, second, third]) == pytest.approx(0.40)

    # The stopped items hold no lease: their worker's report of the failure is refused, and raises nothing.
    for stopped in (first, third):
        with pytest.raises(grpc.aio.AioRpcError):
            await engine.tasks.Fail(
                external_task_pb2.FailRequest(
                    task_id=stopped.id,
                    worker_id="w",
                    lease_token=stopped.lease_token,
                    error_code="LIMIT_EXCEEDED",
                    error_message="budget",
                    no_retry=True,
                )
            )
    assert len(await open_incidents(engine, instance_id)) == 1
    assert await fetch(engine, "w2", TOPIC, max_tasks=10) == []

    # The operator's RETRY of the one incident puts both stopped items back in the queue.
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    again_offered = await fetch(engine, "w2", TOPIC, max_tasks=10)
    assert sorted(t.id for t in again_offered) == sorted([first.id, third.id])


async def test_items_beginning_calls_at_once_cannot_both_pass_the_budget(engine) -> None:
    instance_id, items = await fan_out_of(engine, lines=10, items_at_once=10)
    await started(engine, items[0], 1)
    await finished(engine, items[0], 1)  # $0.20 spent: room for exactly one more call of $0.20
    outcomes = await asyncio.gather(*(started(engine, item, 1) for item in items[1:]), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(outcomes) - len(refused) == 1, outcomes
    assert all(refused_for_the_shared_budget(error) for error in refused)
    (incident,) = await open_incidents(engine, instance_id)
    assert incident.type == "LIMIT_EXCEEDED"
    history = await history_types(engine, instance_id)
    assert history.count(("INCIDENT_RAISED", "triage")) == 1
    assert history.count(("ITEM_STOPPED", "triage")) == len(refused) - 1


async def test_a_node_budget_without_for_each_still_counts_its_own_task_alone(engine) -> None:
    """Two instances of a plain agent node under the same budget: each task has its own."""
    single = (
        bundle(1)
        .replace("for_each: ${lines}\n        as: line\n", "")
        .replace("        max_concurrency: 1\n", "")
    )
    single = single.replace('inputs: { line: "${line}" }', "").replace("        collect: verdicts\n", "")
    await deploy(engine, single)
    for _ in range(2):
        await start(engine, "invoice")
    tasks = await fetch(engine, "w", TOPIC, max_tasks=2)
    for task in tasks:
        await started(engine, task, 1)
        await finished(engine, task, 1)
        await started(engine, task, 2)  # $0.20 of its own spent: under its $0.50
        await finished(engine, task, 2)
        await started(engine, task, 3)
        await finished(engine, task, 3)  # $0.60
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await started(engine, task, 4)
        assert error_info(caught.value).metadata["scope"] == "node"


async def test_an_items_own_limit_incident_is_not_the_budgets(engine) -> None:
    """An item that failed on a limit of its own (an incident of the same type) neither absorbs the
    budget's stop nor, retried, releases the items the budget stopped."""
    instance_id, (own, spender, late) = await fan_out_of(engine, lines=3, items_at_once=3)
    failed = await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=own.id,
            worker_id="w",
            lease_token=own.lease_token,
            error_code="LIMIT_EXCEEDED",
            error_message="max_model_calls reached",
            error_details=struct({"limit": "max_model_calls"}),
            no_retry=True,
        )
    )
    for sequence in (1, 2):
        await started(engine, spender, sequence)
        await finished(engine, spender, sequence)  # $0.40 spent
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(engine, late, 1)
    assert refused_for_the_shared_budget(caught.value)

    incidents = {i.task_id: i for i in await open_incidents(engine, instance_id)}
    assert set(incidents) == {own.id, late.id}
    assert incidents[own.id].id == failed.incident_id
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=failed.incident_id, resolution=incident_pb2.RESOLUTION_RETRY
        )
    )
    assert [t.id for t in await fetch(engine, "w2", TOPIC, max_tasks=10)] == [own.id]
