"""Takeover after a worker dies: the whole journal comes back, and a write is never re-sent blindly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from abada.engine.v1 import external_task_pb2 as et
from abada.engine.v1 import incident_pb2, process_pb2
from abada_engine.runtime.journal import Takeover
from engine_helpers import (
    append,
    complete,
    error_info,
    fetch,
    instance,
    journal,
    plain,
    until_lease_ran_out,
)
from sqlalchemy import text
from test_engine_journal import leased_task, scenario_steps

WRITE = {"callId": "call_2", "arguments": {"customerId": "C-42", "subject": "Parcel not received"}}


async def fetch_taken_over(engine):
    """Fetch the expired task. The engine's reaper locks expired agent tasks (SKIP LOCKED) while it
    looks at their journals, and a fetch in that moment skips the task: poll, as a worker does."""
    for _ in range(100):
        tasks = await fetch(engine, "w2", "abada:agent")
        if tasks:
            return tasks
        await asyncio.sleep(0.05)
    raise AssertionError("the expired task was never offered again")


async def crash_during_the_write(engine, crm, idempotency):
    """Steps 1-3 finished, step 4 (create_ticket) STARTED, then the worker is gone and its lease runs out."""
    # 3 s: the six appends must fit in the lease even on a loaded machine (the engine runs on this loop).
    task = await leased_task(engine, crm, idempotency=idempotency, lease_ms=3000)
    await scenario_steps(engine, task)
    started = await append(engine, task, 4, "TOOL_CALL", "STARTED", "crm/create_ticket", request=WRITE)
    await until_lease_ran_out(task)
    return task, started


async def test_keyed_write_is_offered_again_with_its_key_and_the_new_attempt_finishes_it(
    engine, crm_credentials
):
    task, started = await crash_during_the_write(engine, crm_credentials, "key")
    [again] = await fetch_taken_over(engine)
    assert (again.id, again.attempt) == (task.id, 2)
    steps = list(again.steps)
    assert [(s.sequence, et.StepState.Name(s.state)) for s in steps] == [
        (1, "STEP_STATE_COMPLETED"),
        (2, "STEP_STATE_COMPLETED"),
        (3, "STEP_STATE_COMPLETED"),
        (4, "STEP_STATE_STARTED"),
    ]
    assert steps[3].idempotency_key == started.idempotency_key
    assert plain(steps[3].request) == WRITE
    assert plain(steps[1].response) == {"structuredContent": {"name": "Alice", "tier": "gold"}}
    # The new holder re-sends with the same key and journals the result at the same sequence.
    done = await append(
        engine,
        again,
        4,
        "TOOL_CALL",
        "COMPLETED",
        "crm/create_ticket",
        worker_id="w2",
        response={"structuredContent": {"ticketId": "T-981"}},
    )
    assert done.idempotency_key == started.idempotency_key
    assert done.step.attempt == 1  # the step keeps the attempt that started it, and so its key


async def test_an_orphaned_model_call_is_marked_abandoned_when_the_next_attempt_runs_it_again(
    engine, crm_credentials
):
    task = await leased_task(engine, crm_credentials, lease_ms=1000)
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await until_lease_ran_out(task)
    [again] = await fetch_taken_over(engine)
    assert [(s.sequence, s.abandoned) for s in again.steps] == [(1, False)]
    # The old attempt's STARTED model call cannot be finished by the new one...
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await append(engine, again, 1, "MODEL_CALL", "COMPLETED", worker_id="w2", response={"text": "x"})
    assert error_info(caught.value).reason == "SEQUENCE_CONFLICT"
    # ...it is re-run at the next sequence, and the orphan is marked abandoned.
    await append(engine, again, 2, "MODEL_CALL", "STARTED", worker_id="w2", request={"turn": 0})
    steps = await journal(engine, task.id)
    assert [(s.sequence, s.attempt, s.abandoned) for s in steps] == [(1, 1, True), (2, 2, False)]


async def _unknown_outcome_incident(engine, crm):
    task, _ = await crash_during_the_write(engine, crm, "none")
    assert await fetch(engine, "w2", "abada:agent") == []  # held: never offered with an unkeyed STARTED write
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    return task, incident


async def test_unkeyed_write_becomes_outcome_unknown_and_waits_for_a_person(engine, db, crm_credentials):
    task, incident = await _unknown_outcome_incident(engine, crm_credentials)
    assert incident.type == "TOOL_OUTCOME_UNKNOWN"
    assert incident.task_id == task.id
    details = plain(incident.details)
    assert (details["sequence"], details["tool_ref"], details["attempt"]) == (4, "crm/create_ticket", 1)
    assert details["request"] == WRITE  # opened from the journal for the operator who asks
    # At rest the incident only points at its journal step: the arguments are not there in clear.
    async with db.connect() as conn:
        stored = (
            await conn.execute(
                text("SELECT details::text FROM incidents WHERE id = :id"), {"id": incident.id}
            )
        ).scalar_one()
    assert "request" not in stored and "Parcel not received" not in stored
    steps = await journal(engine, task.id)
    assert et.StepState.Name(steps[3].state) == "STEP_STATE_OUTCOME_UNKNOWN"
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # a blind retry is exactly what must not happen
        await engine.incidents.ResolveIncident(
            incident_pb2.ResolveIncidentRequest(
                incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY
            )
        )
    assert error_info(caught.value).reason == "RESOLUTION_NOT_APPLICABLE"


async def test_resolved_as_happened_the_result_is_journaled_and_the_task_goes_on(engine, crm_credentials):
    _, incident = await _unknown_outcome_incident(engine, crm_credentials)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.incidents.ResolveIncident(
            incident_pb2.ResolveIncidentRequest(
                incident_id=incident.id, resolution=incident_pb2.RESOLUTION_HAPPENED
            )
        )
    assert error_info(caught.value).metadata["field"] == "result"
    result = {"structuredContent": {"ticketId": "T-981"}, "resolvedBy": "a person"}
    request = incident_pb2.ResolveIncidentRequest(
        incident_id=incident.id, resolution=incident_pb2.RESOLUTION_HAPPENED, comment="I see T-981 in the CRM"
    )
    request.result.update(result)
    await engine.incidents.ResolveIncident(request)
    [again] = await fetch_taken_over(engine)
    assert again.attempt == 2
    assert et.StepState.Name(again.steps[3].state) == "STEP_STATE_COMPLETED"
    assert plain(again.steps[3].response) == result
    await complete(engine, again, "w2", {"triage": {"ticketId": "T-981"}})
    assert (await instance(engine, again.instance_id)).state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_resolved_as_did_not_happen_the_step_is_set_aside_for_a_new_call(engine, crm_credentials):
    _, incident = await _unknown_outcome_incident(engine, crm_credentials)
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=incident.id, resolution=incident_pb2.RESOLUTION_DID_NOT_HAPPEN
        )
    )
    [again] = await fetch_taken_over(engine)
    set_aside = again.steps[3]
    assert (et.StepState.Name(set_aside.state), set_aside.abandoned) == ("STEP_STATE_OUTCOME_UNKNOWN", True)
    # The new attempt calls the tool again at a new sequence.
    await append(engine, again, 5, "TOOL_CALL", "STARTED", "crm/create_ticket", worker_id="w2", request=WRITE)


async def test_resolved_by_cancelling_the_instance(engine, crm_credentials):
    task, incident = await _unknown_outcome_incident(engine, crm_credentials)
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=incident.id, resolution=incident_pb2.RESOLUTION_CANCEL_INSTANCE
        )
    )
    assert (await instance(engine, task.instance_id)).state == process_pb2.INSTANCE_STATE_CANCELED
    assert await fetch(engine, "w2", "abada:agent") == []


async def test_the_incident_is_raised_when_the_lease_runs_out_even_if_no_worker_asks_again(
    engine, crm_credentials
):
    task, _ = await crash_during_the_write(engine, crm_credentials, "none")
    # No fetch: the engine's own reaper (every 2 s) notices the expired lease over the unkeyed write
    # once its holder has had the grace past expiry to come back (5 s in the suite) and did not.
    for _ in range(300):  # bounded: 30 s, for a slow round on a loaded machine
        listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())
        if listed.incidents:
            break
        await asyncio.sleep(0.1)
    [incident] = listed.incidents
    assert (incident.type, incident.task_id) == ("TOOL_OUTCOME_UNKNOWN", task.id)
    steps = await journal(engine, task.id)
    assert et.StepState.Name(steps[3].state) == "STEP_STATE_OUTCOME_UNKNOWN"
    assert await fetch(engine, "w2", "abada:agent") == []


async def test_the_reaper_leaves_keyed_writes_and_live_leases_alone(engine, crm_credentials, engine_core):
    task, _ = await crash_during_the_write(engine, crm_credentials, "key")
    assert await engine_core.takeover.hold_expired_unkeyed_writes() == 0
    [again] = await fetch_taken_over(engine)
    assert again.id == task.id and again.attempt == 2


async def test_a_holder_back_within_the_grace_journals_its_unkeyed_write_and_goes_on_without_a_person(
    engine, crm_credentials, engine_core
):
    """The worker was only cut off (the engine restarting, PostgreSQL or the network away) while its
    unkeyed write was in flight, and comes back after its lease ran out with the write's answer.
    Nobody took the task over, so the reaper leaves it to its holder for the grace: the late
    COMPLETED is journaled, the lease re-granted, and the task finishes with no incident."""
    task, _ = await crash_during_the_write(engine, crm_credentials, "none")
    # What the reaper sees now: a lease over an unkeyed write that ran out less than the grace ago.
    patient = Takeover(
        engine_core.db, engine_core.catalog, engine_core.journal.sealer, engine_core.handed_out, 60.0
    )
    assert await patient.hold_expired_unkeyed_writes() == 0
    result = {"structuredContent": {"ticketId": "T-981"}}
    late = await append(engine, task, 4, "TOOL_CALL", "COMPLETED", "crm/create_ticket", response=result)
    assert late.step.state == et.STEP_STATE_COMPLETED
    await engine.tasks.ExtendLease(
        et.ExtendLeaseRequest(task_id=task.id, worker_id="w", lease_token=task.lease_token, lease_ms=30_000)
    )
    await complete(engine, task, "w", {"triage": {"ticketId": "T-981"}})
    assert (await instance(engine, task.instance_id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    assert not (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    steps = await journal(engine, task.id)
    assert [(s.sequence, s.attempt, et.StepState.Name(s.state)) for s in steps][3] == (
        4,
        1,
        "STEP_STATE_COMPLETED",
    )
    assert plain(steps[3].response) == result
