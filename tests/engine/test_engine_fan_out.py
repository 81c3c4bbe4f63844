"""Several tokens in one instance: a `parallel` forks, a `join` waits for all of its branches or lets
the first through; cancels and incidents act on branches. A real engine over gRPC on PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import (
    complete,
    crm_tool_server,
    deploy,
    fetch,
    history_types,
    instance,
    plain,
    start,
    struct,
    verify_lease,
)

QUOTES = """
processes:
  - id: quotes
    start: ask
    nodes:
      - { id: ask, type: parallel, branches: [a, b, c] }
      - { id: a, type: service, topic: supplier-a, retries: 0, next: gather }
      - { id: b, type: service, topic: supplier-b, next: gather }
      - { id: c, type: user_task, next: gather }
      - { id: gather, type: join, wait_for: all, next: decide }
      - { id: decide, type: service, topic: decide, next: done }
      - { id: done, type: end }
  - id: fastest
    start: ask
    nodes:
      - { id: ask, type: parallel, branches: [a, b, c] }
      - { id: a, type: service, topic: fast-a, next: first }
      - { id: b, type: service, topic: fast-b, next: first }
      - { id: c, type: user_task, next: first }
      - { id: first, type: join, wait_for: any, next: done }
      - { id: done, type: end }
  - id: timed
    start: fork
    nodes:
      - { id: fork, type: parallel, branches: [pause, work] }
      - { id: pause, type: timer, duration: PT1S, next: after }
      - { id: after, type: service, topic: after-pause, next: both }
      - { id: work, type: service, topic: timed-work, next: both }
      - { id: both, type: join, next: done }
      - { id: done, type: end }
  - id: two_timers
    start: fork
    nodes:
      - { id: fork, type: parallel, branches: [one, two] }
      - { id: one, type: timer, duration: PT1S, next: after_one }
      - { id: two, type: timer, duration: PT1S, next: after_two }
      - { id: after_one, type: service, topic: after-timers, next: both }
      - { id: after_two, type: service, topic: after-timers, next: both }
      - { id: both, type: join, next: done }
      - { id: done, type: end }
"""


async def user_tasks(engine: Any, instance_id: str) -> list[process_pb2.UserTask]:
    listed = await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=instance_id))
    return list(listed.user_tasks)


async def complete_user_task(engine: Any, task: process_pb2.UserTask, **variables: Any) -> None:
    await engine.processes.CompleteUserTask(
        process_pb2.CompleteUserTaskRequest(user_task_id=task.id, variables=struct(variables))
    )


async def test_a_fork_runs_its_branches_at_once_and_the_join_waits_for_all_of_them(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "quotes", order="O-1")
    shown = await instance(engine, started.id)
    assert sorted(shown.active_node_ids) == ["a", "b", "c"]
    [a] = await fetch(engine, "w", "supplier-a")
    [b] = await fetch(engine, "w", "supplier-b")
    [c] = await user_tasks(engine, started.id)
    assert plain(a.variables) == plain(b.variables) == {"order": "O-1"}

    await complete(engine, a, "w", {"quote_a": 10})
    await complete_user_task(engine, c, quote_c=12)
    waiting = await instance(engine, started.id)
    assert waiting.state == process_pb2.INSTANCE_STATE_ACTIVE and list(waiting.active_node_ids) == ["b"]
    assert await fetch(engine, "w", "decide") == []

    await complete(engine, b, "w", {"quote_b": 11})
    [decide] = await fetch(engine, "w", "decide")
    # Every branch's writes reach the node after the join.
    assert plain(decide.variables) == {"order": "O-1", "quote_a": 10, "quote_b": 11, "quote_c": 12}
    history = await history_types(engine, started.id)
    assert history.count(("JOIN_WAITING", "gather")) == 2 and history.count(("JOIN_PASSED", "gather")) == 1
    # Each branch has its own lines: its node entered, its task created and completed.
    for node in ("a", "b"):
        assert [t for t, n in history if n == node] == [
            "NODE_ENTERED",
            "TASK_CREATED",
            "TASK_COMPLETED",
            "VARIABLE_WRITTEN",
            "NODE_COMPLETED",
        ]
    await complete(engine, decide, "w", {})
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_branches_finishing_together_pass_the_join_exactly_once(engine) -> None:
    await deploy(engine, QUOTES)
    for _ in range(3):
        started = await start(engine, "quotes")
        [a] = await fetch(engine, "w", "supplier-a")
        [b] = await fetch(engine, "w", "supplier-b")
        [c] = await user_tasks(engine, started.id)

        async def finish(task: external_task_pb2.ExternalTask, name: str) -> None:
            # What a worker does when the instance changed under it: send the same answer again.
            for _ in range(20):
                try:
                    await complete(engine, task, "w", {name: 1})
                    return
                except grpc.aio.AioRpcError as error:
                    assert error.code() == grpc.StatusCode.ABORTED, error.details()

        await asyncio.gather(finish(a, "qa"), finish(b, "qb"), complete_user_task(engine, c, qc=1))
        history = await history_types(engine, started.id)
        assert history.count(("JOIN_PASSED", "gather")) == 1, history
        assert history.count(("JOIN_WAITING", "gather")) == 2, history
        [decide] = await fetch(engine, "w", "decide")
        assert decide.instance_id == started.id
        assert {"qa", "qb", "qc"} <= plain(decide.variables).keys()
        await complete(engine, decide, "w", {})


async def test_a_join_on_any_lets_the_first_through_and_withdraws_the_other_branches(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "fastest")
    [a] = await fetch(engine, "w", "fast-a")
    [b] = await fetch(engine, "w", "fast-b")
    await complete(engine, b, "w", {"winner": "b"})
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED and list(done.active_node_ids) == []
    assert plain(done.variables) == {"winner": "b"}
    # The losers' credentials are refused and the person's task is gone.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(engine, a, "w", {"winner": "a"})
    assert refused.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)
    assert await user_tasks(engine, started.id) == []
    assert plain((await instance(engine, started.id)).variables) == {"winner": "b"}


RACE = """
processes:
  - id: race
    start: ask
    nodes:
      - { id: ask, type: parallel, branches: [agent, lookup] }
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Look up ${customerId}.
        tools: [crm/get_customer]
        result_variable: found
        next: first
      - { id: lookup, type: service, topic: race-lookup, next: first }
      - { id: first, type: join, wait_for: any, next: done }
      - { id: done, type: end }
"""


async def test_a_join_on_any_refuses_the_losing_agents_credentials(engine, crm_credentials) -> None:
    await deploy(engine, crm_tool_server(crm_credentials.url, {"get_customer": "{ policy: read }"}) + RACE)
    started = await start(engine, "race", customerId="C-42")
    [agent] = await fetch(engine, "w", "abada:agent")
    [lookup] = await fetch(engine, "w", "race-lookup")
    await verify_lease(engine, agent)  # the broker would hand the agent its CRM credential now

    await complete(engine, lookup, "w", {"found": "by lookup"})

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await verify_lease(engine, agent)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables)["found"] == "by lookup"


async def test_cancelling_a_forked_instance_withdraws_every_branch_task(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "quotes")
    [a] = await fetch(engine, "w", "supplier-a")
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=started.id, reason="no")
    )
    with pytest.raises(grpc.aio.AioRpcError):
        await complete(engine, a, "w", {})
    assert await fetch(engine, "w", "supplier-b") == []
    assert await user_tasks(engine, started.id) == []
    assert list((await instance(engine, started.id)).active_node_ids) == []


async def test_an_incident_holds_its_branch_only(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "quotes")
    [a] = await fetch(engine, "w", "supplier-a")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=a.id, worker_id="w", lease_token=a.lease_token, error_message="down"
        )
    )
    # The other branches go on to the join while the incident holds branch a.
    [b] = await fetch(engine, "w", "supplier-b")
    await complete(engine, b, "w", {"quote_b": 11})
    [c] = await user_tasks(engine, started.id)
    await complete_user_task(engine, c, quote_c=12)
    held = await instance(engine, started.id)
    assert held.state == process_pb2.INSTANCE_STATE_ACTIVE and held.open_incidents == 1
    assert list(held.active_node_ids) == ["a"]
    assert await fetch(engine, "w", "decide") == []

    [incident] = (
        await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=started.id))
    ).incidents
    assert incident.node_id == "a"
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    [again] = await fetch(engine, "w", "supplier-a")
    await complete(engine, again, "w", {"quote_a": 10})
    [decide] = await fetch(engine, "w", "decide")
    assert plain(decide.variables) == {"quote_a": 10, "quote_b": 11, "quote_c": 12}


async def test_a_timer_in_one_branch_fires_while_the_other_branch_works(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "timed")
    assert sorted((await instance(engine, started.id)).active_node_ids) == ["pause", "work"]
    [work] = await fetch(engine, "w", "timed-work")
    await complete(engine, work, "w", {"worked": True})
    [after] = await fetch(engine, "w", "after-pause", wait_ms=5_000)
    await complete(engine, after, "w", {"paused": True})
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables) == {"worked": True, "paused": True}


async def test_two_branches_timers_due_together_both_fire(engine) -> None:
    await deploy(engine, QUOTES)
    started = await start(engine, "two_timers")
    fetched: list[external_task_pb2.ExternalTask] = []
    for _ in range(20):
        fetched += await fetch(engine, "w", "after-timers", max_tasks=2, wait_ms=1_000)
        if len(fetched) == 2:
            break
    assert sorted(t.node_id for t in fetched) == ["after_one", "after_two"]
    history = await history_types(engine, started.id)
    assert ("TIMER_FIRED", "one") in history and ("TIMER_FIRED", "two") in history
