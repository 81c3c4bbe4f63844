"""The output contract: invalid output and low confidence take their routes or raise incidents."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import complete, deploy, error_info, fetch, history_types, instance, plain, start

ROUTED = """
processes:
  - id: triage
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: decide
        result_variable: triage
        output_schema: { type: object, required: [ticketId, priority] }
        confidence_threshold: 80
        on_invalid_output: review
        on_low_confidence: review
        next: notify
      - { id: notify, type: service, topic: notify, next: done }
      - { id: review, type: user_task, next: done }
      - { id: done, type: end }
"""
UNROUTED = ROUTED.replace(
    "        on_invalid_output: review\n        on_low_confidence: review\n", ""
).replace("      - { id: review, type: user_task, next: done }\n", "")


async def _agent_task(engine, bundle):
    await deploy(engine, bundle)
    started = await start(engine, "triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent")
    return started, task


async def test_valid_confident_answer_advances(engine):
    started, task = await _agent_task(engine, ROUTED)
    done = await complete(
        engine, task, "w", {"triage": {"ticketId": "T-981", "priority": "high"}}, confidence=92
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    assert (await instance(engine, started.id)).current_node_id == "notify"


async def test_invalid_output_takes_its_route_and_writes_nothing(engine):
    started, task = await _agent_task(engine, ROUTED)
    done = await complete(engine, task, "w", {"triage": {"priority": "high"}}, confidence=95)
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "ticketId" in done.reason
    after = await instance(engine, started.id)
    assert after.current_node_id == "review"
    assert "triage" not in plain(after.variables)
    [review] = (await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest())).user_tasks
    rejected = plain(review.variables)["context"]["rejected"]
    assert rejected["output"] == {"triage": {"priority": "high"}}
    assert rejected["verdict"] == "invalid_output"


async def test_low_confidence_takes_its_route(engine):
    started, task = await _agent_task(engine, ROUTED)
    done = await complete(
        engine, task, "w", {"triage": {"ticketId": "T-1", "priority": "low"}}, confidence=40
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_LOW_CONFIDENCE_ROUTED
    assert "40" in done.reason and "80" in done.reason
    assert (await instance(engine, started.id)).current_node_id == "review"


async def test_worker_reported_unparseable_answer_is_invalid_output(engine):
    started, task = await _agent_task(engine, ROUTED)
    done = await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            invalid_output_reason="the model's answer is not JSON",
        )
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert (await instance(engine, started.id)).current_node_id == "review"


@pytest.mark.parametrize(
    ("variables", "confidence", "incident_type"),
    [
        ({"triage": {"priority": "high"}}, 95, "INVALID_OUTPUT"),
        ({"triage": {"ticketId": "T-1", "priority": "high"}}, 10, "LOW_CONFIDENCE"),
        ({"triage": {"ticketId": "T-1", "priority": "high"}}, None, "LOW_CONFIDENCE"),
    ],
)
async def test_without_a_route_an_incident_holds_the_instance_and_nothing_partial_is_visible(
    engine, variables, confidence, incident_type
):
    started, task = await _agent_task(engine, UNROUTED)
    before = await instance(engine, started.id)
    done = await complete(engine, task, "w", variables, confidence=confidence)
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INCIDENT_RAISED
    after = await instance(engine, started.id)
    assert after.current_node_id == "agent"
    assert plain(after.variables) == plain(before.variables)
    assert after.open_incidents == 1
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    assert (incident.type, incident.node_id, incident.task_id) == (incident_type, "agent", task.id)

    # A person retries: the same task comes back (its journal with it) for the model to answer again.
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    [again] = await fetch(engine, "w2", "abada:agent")
    assert (again.id, again.attempt) == (task.id, 2)
    await complete(engine, again, "w2", {"triage": {"ticketId": "T-2", "priority": "low"}}, confidence=99)
    assert (await instance(engine, started.id)).current_node_id == "notify"


async def test_writing_another_variable_is_refused_and_changes_nothing(engine):
    started, task = await _agent_task(engine, ROUTED)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(
            engine, task, "w", {"triage": {"ticketId": "T", "priority": "p"}, "approved": True}, confidence=99
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).reason == "VARIABLE_NOT_ALLOWED"
    assert (await instance(engine, started.id)).current_node_id == "agent"
    # The lease survives a refused call: the holder can still complete properly.
    done = await complete(engine, task, "w", {"triage": {"ticketId": "T", "priority": "p"}}, confidence=99)
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    assert ("OUTPUT_REJECTED", "agent") not in await history_types(engine, started.id)


async def test_retrying_a_rejected_answer_asks_the_model_again_without_repeating_any_tool(engine):
    """The journal keeps every tool result; only the rejected answer's model call is set aside."""
    from engine_helpers import append

    await deploy(engine, UNROUTED)
    await start(engine, "triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "not json"}, tokens=(10, 5))
    done = await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id, worker_id="w", lease_token=task.lease_token, invalid_output_reason="not JSON"
        )
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INCIDENT_RAISED
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=done.incident_id, resolution=incident_pb2.RESOLUTION_RETRY
        )
    )
    [again] = await fetch(engine, "w2", "abada:agent")
    assert again.id == task.id
    assert [(s.sequence, s.abandoned) for s in again.steps] == [(1, True)]
    # The set-aside answer no longer counts against max_model_calls; the next call journals at 2.
    await append(engine, again, 2, "MODEL_CALL", "STARTED", worker_id="w2", request={"turn": 0})


async def test_a_change_to_the_instance_after_the_fetch_is_not_lost_by_complete(engine, db):
    """Complete usually decides on the instance as it was handed out; a change since then is seen."""
    from sqlalchemy import text

    started, task = await _agent_task(engine, ROUTED)
    async with db.begin() as conn:
        await conn.execute(
            text(
                'UPDATE instances SET variables = variables || \'{"lateNote": "added by a person"}\' WHERE id = :id'
            ),
            {"id": started.id},
        )
    await complete(engine, task, "w", {"triage": {"ticketId": "T-9", "priority": "high"}}, confidence=90)
    final = plain((await instance(engine, started.id)).variables)
    assert final["lateNote"] == "added by a person"
    assert final["triage"] == {"ticketId": "T-9", "priority": "high"}


async def test_a_non_holder_learns_nothing_about_the_node_from_a_bad_complete(engine):
    _, task = await _agent_task(engine, ROUTED)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(engine, task, "intruder", {"approved": True}, confidence=99)
    assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
