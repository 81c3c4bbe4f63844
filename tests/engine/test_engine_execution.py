"""An instance through agent -> exclusive -> service -> end, driven by a test worker."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import complete, deploy, error_info, fetch, history_types, instance, plain, start, struct

FLOW = """
processes:
  - id: triage_flow
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: "Triage the message from ${customerId}: ${message}"
        inputs: { customerId: "${customerId}", message: "${message}", tier: "${customer.tier}" }
        result_variable: triage
        output_schema:
          type: object
          required: [priority]
          properties: { priority: { enum: [low, high] } }
        confidence_threshold: 80
        limits: { max_model_calls: 4, max_tool_calls: 2, max_tokens: 1000 }
        next: route
      - id: route
        type: exclusive
        branches:
          - { when: 'triage.priority == "high"', next: escalate }
        default: file_it
      - { id: escalate, type: service, topic: escalations, inputs: { who: "${customerId}", triage: "${triage}" }, next: done }
      - { id: file_it, type: service, topic: filing, next: done }
      - { id: done, type: end }
"""


async def test_instance_runs_agent_exclusive_service_end_with_full_history(engine):
    await deploy(engine, FLOW)
    started = await start(
        engine, "triage_flow", customerId="C-42", message="My parcel never arrived", customer={"tier": "gold"}
    )
    assert started.current_node_id == "triage"

    [task] = await fetch(engine, "agent-worker-1", "abada:agent")
    assert task.attempt == 1 and task.lease_token
    assert plain(task.variables) == {
        "customerId": "C-42",
        "message": "My parcel never arrived",
        "tier": "gold",
    }
    work = task.agent_work
    assert work.profile_version == "abada.agent/v1"
    assert work.model == "gemini-3.6-flash"
    # References point at the inputs carrying the values; no value is pasted into the instructions.
    assert work.prompt == 'Triage the message from [input "customerId"]: [input "message"]'
    assert work.result_variable == "triage"
    assert work.confidence_threshold == 80
    assert (work.limits.max_model_calls, work.limits.max_tool_calls, work.limits.max_tokens) == (4, 2, 1000)
    assert plain(work.output_schema)["required"] == ["priority"]

    done = await complete(
        engine,
        task,
        "agent-worker-1",
        {"triage": {"priority": "high", "n": 3}},
        confidence=92,
        model="gemini-3.6-flash",
        provider="gemini",
        input_tokens=120,
        output_tokens=40,
        tools_used=["crm/get_customer"],
        duration_ms=850,
        prompt_hash="ab" * 32,
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    assert done.next_node_id == "escalate"

    [service_task] = await fetch(engine, "notifier-1", "escalations")
    assert plain(service_task.variables) == {"who": "C-42", "triage": {"priority": "high", "n": 3}}
    assert not service_task.HasField("agent_work")
    await complete(engine, service_task, "notifier-1", {"escalated": True})

    final = await instance(engine, started.id)
    assert final.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert final.current_node_id == "done"
    assert plain(final.variables)["triage"] == {"priority": "high", "n": 3}
    assert plain(final.variables)["escalated"] is True

    assert await history_types(engine, started.id) == [
        ("INSTANCE_STARTED", ""),
        ("NODE_ENTERED", "triage"),
        ("TASK_CREATED", "triage"),
        ("TASK_COMPLETED", "triage"),
        ("VARIABLE_WRITTEN", "triage"),
        ("NODE_COMPLETED", "triage"),
        ("NODE_ENTERED", "route"),
        ("BRANCH_TAKEN", "route"),
        ("NODE_ENTERED", "escalate"),
        ("TASK_CREATED", "escalate"),
        ("TASK_COMPLETED", "escalate"),
        ("VARIABLE_WRITTEN", "escalate"),
        ("NODE_COMPLETED", "escalate"),
        ("NODE_ENTERED", "done"),
        ("INSTANCE_COMPLETED", "done"),
    ]
    events = (await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))).events
    completed = next(e for e in events if e.type == "TASK_COMPLETED" and e.node_id == "triage")
    metadata = plain(completed.data)["metadata"]
    assert metadata["model"] == "gemini-3.6-flash"
    assert metadata["provider"] == "gemini"
    assert (metadata["input_tokens"], metadata["output_tokens"]) == (120, 40)
    assert metadata["tools_used"] == ["crm/get_customer"]
    assert metadata["duration_ms"] == 850
    assert metadata["confidence"] == 92
    assert metadata["prompt_hash"] == "ab" * 32


async def test_default_branch_is_taken_when_no_condition_holds(engine):
    await deploy(engine, FLOW)
    started = await start(engine, "triage_flow", customerId="C-7", message="hi", customer={"tier": "silver"})
    [task] = await fetch(engine, "w", "abada:agent")
    done = await complete(engine, task, "w", {"triage": {"priority": "low"}}, confidence=99)
    assert done.next_node_id == "file_it"
    [filing] = await fetch(engine, "w", "filing")
    # Without declared inputs a service task carries every variable.
    assert plain(filing.variables)["customerId"] == "C-7"
    assert (await instance(engine, started.id)).current_node_id == "file_it"


async def test_missing_input_variable_raises_an_incident_at_the_node(engine):
    await deploy(engine, FLOW)
    started = await start(engine, "triage_flow", customerId="C-1", message="hello")  # no customer.tier
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=started.id))
    incidents = listed.incidents
    assert [(i.type, i.node_id) for i in incidents] == [("INPUT_MISSING", "triage")]
    assert "customer.tier" in incidents[0].message
    assert await fetch(engine, "w", "abada:agent") == []


async def test_user_task_waits_for_a_person(engine):
    await deploy(
        engine,
        """
processes:
  - id: approve
    start: ask
    nodes:
      - { id: ask, type: user_task, inputs: { amount: "${amount}" }, next: done }
      - { id: done, type: end }
""",
    )
    started = await start(engine, "approve", amount=120)
    listed = await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=started.id))
    [waiting] = listed.user_tasks
    assert waiting.node_id == "ask"
    assert plain(waiting.variables)["inputs"] == {"amount": 120}
    finished = await engine.processes.CompleteUserTask(
        process_pb2.CompleteUserTaskRequest(user_task_id=waiting.id, variables=struct({"approved": True}))
    )
    assert finished.instance.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(finished.instance.variables) == {"amount": 120, "approved": True}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.processes.CompleteUserTask(process_pb2.CompleteUserTaskRequest(user_task_id=waiting.id))
    assert error_info(caught.value).reason == "TASK_NOT_WAITING"


async def test_cancel_instance_withdraws_its_task(engine):
    await deploy(engine, FLOW)
    started = await start(engine, "triage_flow", customerId="C-9", message="x", customer={"tier": "gold"})
    canceled = await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=started.id, reason="customer withdrew")
    )
    assert canceled.instance.state == process_pb2.INSTANCE_STATE_CANCELED
    assert await fetch(engine, "w", "abada:agent") == []
    assert ("INSTANCE_CANCELED", "") in await history_types(engine, started.id)
