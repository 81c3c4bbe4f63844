"""Repairing running instances over gRPC: ModifyInstance (variables, token moves withdrawing the task
left) and MigrateInstances (a checked plan, renamed nodes, the new version's prompt afterwards)."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import (
    ONE_SERVICE_TASK,
    append,
    complete,
    deploy,
    error_info,
    fetch,
    instance,
    journal,
    plain,
    start,
    struct,
    verify_lease,
)

AGENT = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      get_customer: {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: none }}
processes:
  - id: repaired
    start: split
    nodes:
      - {{ id: split, type: parallel, branches: [triage, check] }}
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Open a ticket for ${{customerId}}.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        deadline: PT1H
        on_deadline: review
        next: merge
      - {{ id: check, type: service, topic: checks, next: merge }}
      - {{ id: review, type: user_task, next: merge }}
      - {{ id: merge, type: join, wait_for: all, next: done }}
      - {{ id: done, type: end }}
"""


async def _history(engine, instance_id: str) -> list[process_pb2.HistoryEvent]:
    response = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id))
    return list(response.events)


async def test_a_variable_set_and_a_token_moved_mid_flight_withdraw_the_agent_task(engine, crm_credentials):
    await deploy(engine, AGENT.format(url=crm_credentials.url))
    started = await start(engine, "repaired", customerId="C-42", stale="old")
    [task] = await fetch(engine, "w", "abada:agent")
    ticket = {"callId": "call_0", "name": "crm__create_ticket", "arguments": {"customerId": "C-42"}}
    await append(engine, task, 1, "TOOL_CALL", "STARTED", tool_ref="crm/create_ticket", request=ticket)

    request = process_pb2.ModifyInstanceRequest(
        instance_id=started.id,
        set_variables=struct({"customerId": "C-43"}),
        unset_variables=["stale"],
        moves=[process_pb2.NodeMapping(from_node_id="triage", to_node_id="review")],
        reason="wrong customer in the ticket",
    )
    modified = (await engine.processes.ModifyInstance(request)).instance
    assert plain(modified.variables) == {"customerId": "C-43"}
    # The other branch's token stays where it was; the moved one waits at the review.
    assert sorted(modified.active_node_ids) == ["check", "review"]

    # The withdrawn task's worker is refused: its credential, and its journal.
    with pytest.raises(grpc.aio.AioRpcError) as credential:
        await verify_lease(engine, task)
    assert credential.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as appended:
        await append(
            engine,
            task,
            1,
            "TOOL_CALL",
            "COMPLETED",
            tool_ref="crm/create_ticket",
            request=ticket,
            response={},
        )
    assert error_info(appended.value).reason == "TASK_NOT_LEASED"
    # Its write was in flight: nobody knows whether it happened.
    [step] = await journal(engine, task.id)
    assert step.state == external_task_pb2.STEP_STATE_OUTCOME_UNKNOWN

    events = await _history(engine, started.id)
    changes = [
        (e.type, plain(e.data)) for e in events if e.type in ("VARIABLE_SET", "VARIABLE_UNSET", "TOKEN_MOVED")
    ]
    assert [(t, d.get("name", d.get("to_node_id"))) for t, d in changes] == [
        ("VARIABLE_UNSET", "stale"),
        ("VARIABLE_SET", "customerId"),
        ("TOKEN_MOVED", "review"),
    ]
    for _, data in changes:
        assert data["by"] == "test-suite"
        assert data["reason"] == "wrong customer in the ticket"

    # The repaired instance goes on: the review and the other branch finish it.
    [check] = await fetch(engine, "w", "checks")
    await complete(engine, check, "w", {})
    [review] = (
        await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=started.id))
    ).user_tasks
    await engine.processes.CompleteUserTask(process_pb2.CompleteUserTaskRequest(user_task_id=review.id))
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_a_move_from_a_node_without_a_token_and_a_finished_instance_are_refused(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    with pytest.raises(grpc.aio.AioRpcError) as nowhere:
        await engine.processes.ModifyInstance(
            process_pb2.ModifyInstanceRequest(
                instance_id=started.id,
                moves=[process_pb2.NodeMapping(from_node_id="done", to_node_id="work")],
                reason="no token rests at done",
            )
        )
    assert error_info(nowhere.value).reason == "NO_TOKEN_AT_NODE"

    [task] = await fetch(engine, "w", "jobs")
    await complete(engine, task, "w", {})
    with pytest.raises(grpc.aio.AioRpcError) as finished:
        await engine.processes.ModifyInstance(
            process_pb2.ModifyInstanceRequest(
                instance_id=started.id, set_variables=struct({"x": 1}), reason="too late"
            )
        )
    assert finished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(finished.value).reason == "INSTANCE_NOT_ACTIVE"
    assert "x" not in plain((await instance(engine, started.id)).variables)


def _triage(node_id: str, prompt: str) -> str:
    return f"""
processes:
  - id: triage_flow
    start: {node_id}
    nodes:
      - id: {node_id}
        type: agent
        model: gemini-3.6-flash
        prompt: {prompt} ${{customerId}}
        inputs: {{ customerId: "${{customerId}}" }}
        result_variable: answer
        deadline: PT1H
        on_deadline: notify
        limits: {{ max_model_calls: 1, max_tool_calls: 0, max_tokens: 1000 }}
        next: done
      - {{ id: notify, type: user_task, next: done }}
      - {{ id: done, type: end }}
"""


def _migrate(dry_run: bool = False, **mappings: str) -> process_pb2.MigrateInstancesRequest:
    return process_pb2.MigrateInstancesRequest(
        process_id="triage_flow",
        from_version=1,
        to_version=2,
        mappings=[process_pb2.NodeMapping(from_node_id=k, to_node_id=v) for k, v in mappings.items()],
        dry_run=dry_run,
    )


async def test_fifty_waiting_instances_migrate_to_v2_with_a_renamed_node_and_its_prompt(engine):
    await deploy(engine, _triage("triage", "Old prompt for"))
    started = [await start(engine, "triage_flow", customerId=f"C-{n}") for n in range(50)]
    second = await deploy(engine, _triage("classify", "New prompt for"))
    [v2] = second.definitions
    assert v2.version == 2

    # A plan that cannot map the node is refused whole, naming it; so is one mapping it to another type.
    with pytest.raises(grpc.aio.AioRpcError) as unmapped:
        await engine.processes.MigrateInstances(_migrate())
    assert error_info(unmapped.value).reason == "MIGRATION_PLAN_INVALID"
    assert error_info(unmapped.value).metadata["node_id"] == "triage"
    assert error_info(unmapped.value).metadata["node_ids"] == "triage"
    with pytest.raises(grpc.aio.AioRpcError) as retyped:
        await engine.processes.MigrateInstances(_migrate(triage="notify"))
    assert error_info(retyped.value).reason == "MIGRATION_PLAN_INVALID"
    assert "user_task" in retyped.value.details()

    dry = await engine.processes.MigrateInstances(_migrate(dry_run=True, triage="classify"))
    assert (dry.instances, dry.dry_run) == (50, True)
    assert [(m.from_node_id, m.to_node_id) for m in dry.plan] == [("triage", "classify")]
    # The refusals and the dry run moved nothing.
    for one in started:
        assert (await instance(engine, one.id)).version == 1

    migrated = await engine.processes.MigrateInstances(_migrate(triage="classify"))
    assert (migrated.instances, migrated.dry_run) == (50, False)

    tasks = await fetch(engine, "w", "abada:agent", max_tasks=50)
    assert len(tasks) == 50
    for task in tasks:
        assert task.node_id == "classify"
        # A prompt names its inputs; the values travel beside it.
        assert task.agent_work.prompt == 'New prompt for [input "customerId"]'
        assert plain(task.variables)["customerId"].startswith("C-")
    first = await instance(engine, started[0].id)
    assert (first.version, first.definition_id) == (2, v2.id)
    [entry] = [e for e in await _history(engine, started[0].id) if e.type == "INSTANCE_MIGRATED"]
    data = plain(entry.data)
    assert (data["from_version"], data["to_version"], data["by"]) == (1, 2, "test-suite")
    assert data["nodes"] == {"triage": "classify"}
    # Nothing is left on v1 to migrate.
    again = await engine.processes.MigrateInstances(_migrate(triage="classify"))
    assert again.instances == 0


async def test_a_task_in_flight_keeps_its_attempt_and_finishes_on_the_new_version(engine):
    await deploy(engine, _triage("triage", "Old prompt for"))
    started = await start(engine, "triage_flow", customerId="C-1")
    [task] = await fetch(engine, "w", "abada:agent")
    await deploy(engine, _triage("classify", "New prompt for"))
    migrated = await engine.processes.MigrateInstances(_migrate(triage="classify"))
    assert migrated.instances == 1

    # The worker's lease survived the migration: its answer is taken, judged by v2's node.
    await complete(engine, task, "w", {"answer": {"ok": True}})
    done = await instance(engine, started.id)
    assert (done.state, done.version) == (process_pb2.INSTANCE_STATE_COMPLETED, 2)
    types = [e.type for e in await _history(engine, started.id)]
    assert types.index("INSTANCE_MIGRATED") < types.index("INSTANCE_COMPLETED")


async def test_moving_a_token_onto_its_own_node_starts_the_task_again(engine):
    await deploy(engine, _triage("triage", "Prompt for"))
    started = await start(engine, "triage_flow", customerId="C-1")
    [first] = await fetch(engine, "w", "abada:agent")
    await engine.processes.ModifyInstance(
        process_pb2.ModifyInstanceRequest(
            instance_id=started.id,
            moves=[process_pb2.NodeMapping(from_node_id="triage", to_node_id="triage")],
            reason="stop this attempt",
        )
    )
    [again] = await fetch(engine, "w", "abada:agent")
    assert again.id != first.id and again.node_id == "triage"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(engine, first, "w", {"answer": {}})
    assert error_info(refused.value).reason == "TASK_NOT_LEASED"


ROUTED = """
processes:
  - id: routed
    start: route
    nodes:
      - id: route
        type: exclusive
        branches:
          - { when: 'tier == "gold"', next: gold }
      - { id: gold, type: service, topic: gold-customers, next: done }
      - { id: done, type: end }
"""


async def test_a_token_stuck_on_a_gateway_incident_is_moved_on_and_the_incident_closes(engine):
    await deploy(engine, ROUTED)
    started = await start(engine, "routed", tier="silver")
    assert list((await instance(engine, started.id)).active_node_ids) == ["route"]

    request = process_pb2.ModifyInstanceRequest(
        instance_id=started.id,
        set_variables=struct({"tier": "gold"}),
        moves=[process_pb2.NodeMapping(from_node_id="route", to_node_id="route")],
        reason="the customer is gold",
    )
    moved = (await engine.processes.ModifyInstance(request)).instance
    # The gateway is evaluated again on the corrected variable.
    assert list(moved.active_node_ids) == ["gold"]
    assert moved.open_incidents == 0
    [task] = await fetch(engine, "w", "gold-customers")
    await complete(engine, task, "w", {})
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_a_parallel_instance_migrates_with_every_branch_and_a_refusal_names_every_node(
    engine, crm_credentials
):
    v1 = AGENT.format(url=crm_credentials.url)
    await deploy(engine, v1)
    started = await start(engine, "repaired", customerId="C-42")
    await deploy(engine, v1.replace("triage", "classify").replace("check", "verify"))
    request = process_pb2.MigrateInstancesRequest(process_id="repaired", from_version=1, to_version=2)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await engine.processes.MigrateInstances(request)
    assert error_info(refused.value).metadata["node_ids"] == "check,triage"

    request.mappings.add(from_node_id="triage", to_node_id="classify")
    request.mappings.add(from_node_id="check", to_node_id="verify")
    migrated = await engine.processes.MigrateInstances(request)
    assert migrated.instances == 1
    moved = await instance(engine, started.id)
    assert (moved.version, sorted(moved.active_node_ids)) == (2, ["classify", "verify"])
    [check] = await fetch(engine, "w", "checks")
    assert check.node_id == "verify"
