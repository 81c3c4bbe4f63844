"""A real worker SIGKILLed at each step boundary of Alice's task, for a keyed and an unkeyed write.

One worker per boundary takes one instance and kills itself there (ABADA_WORKER_FAULT, test only);
then one healthy worker takes every task over once its lease has lapsed. Boundaries: after the
model call returned (journaled), after the read, after the write was sent (its answer arrived,
nothing journaled), after the write returned (journaled), before Complete.

A keyed write sent twice is deduplicated by the CRM; an unkeyed write caught in the middle is never
re-sent: the engine raises TOOL_OUTCOME_UNKNOWN and the test, as the operator, looks the ticket up in
the CRM and says it happened. Either way: every instance finishes, one ticket each, no model turn
paid twice, no idempotency key used twice; and afterwards no tool argument, tool result, model turn
or secret is anywhere in a pg_dump of the engine's database in clear (the incident included).
"""

from __future__ import annotations

import pytest
from abada.engine.v1 import incident_pb2, incident_pb2_grpc, process_pb2, process_pb2_grpc
from fault_stack import (
    TOOL_ARGUMENT_MARKER,
    TOOL_RESULT_MARKER,
    judge,
    plaintexts_at_rest,
    running_stack,
    start_instances,
    wait_for,
    wait_until_finished,
)
from google.protobuf import struct_pb2

LEASE_MS = 2_000  # a dead worker's tasks come back after this
# Text only the result a person gives for an unknown write carries: journaled sealed, like any result.
OPERATOR_RESULT_MARKER = "operator [ref OPS-3390-RESULT]"
BOUNDARIES = [
    "kill-at:model-returned",
    "kill-at:read-returned",
    "kill-after-send:crm/create_ticket",
    "kill-at:write-returned",
    "kill-at:before-complete",
]


async def _resolve_unknown_writes(channel, crm) -> int:  # type: ignore[no-untyped-def]
    """As the operator: every TOOL_OUTCOME_UNKNOWN write happened; its result is the CRM's ticket,
    found by the instance's message (the ticket's subject)."""
    incidents = incident_pb2_grpc.IncidentServiceStub(channel)
    processes = process_pb2_grpc.ProcessServiceStub(channel)
    listed = await incidents.ListIncidents(
        incident_pb2.ListIncidentsRequest(type="TOOL_OUTCOME_UNKNOWN", state=incident_pb2.INCIDENT_STATE_OPEN)
    )
    tickets = {ticket["subject"]: ticket for ticket in crm.tickets()}
    resolved = 0
    for incident in listed.incidents:
        found = (
            await processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=incident.instance_id))
        ).instance
        ticket = tickets[dict(found.variables)["message"] + TOOL_ARGUMENT_MARKER]
        result = struct_pb2.Struct()
        result.update(
            {
                "content": [],
                "structuredContent": {"ticketId": ticket["ticketId"], "checkedBy": OPERATOR_RESULT_MARKER},
                "isError": False,
            }
        )
        await incidents.ResolveIncident(
            incident_pb2.ResolveIncidentRequest(
                incident_id=incident.id, resolution=incident_pb2.RESOLUTION_HAPPENED, result=result
            )
        )
        resolved += 1
    return resolved


@pytest.mark.parametrize("idempotency", ["key", "none"])
async def test_a_worker_killed_at_each_step_boundary_is_taken_over_without_a_second_ticket_or_turn(
    tmp_path, shared_database, crm, gemini_url, idempotency
):
    drill = f"worker-sigkill-{idempotency}"
    async with running_stack(tmp_path, shared_database, crm, gemini_url, idempotency=idempotency) as stack:
        # One doomed worker per boundary, each able to hold one task: each takes one instance and dies.
        doomed = [
            stack.add_worker(f"doomed-{n}", extra={"ABADA_WORKER_FAULT": b}, concurrency=1, lease_ms=LEASE_MS)
            for n, b in enumerate(BOUNDARIES)
        ]
        async with stack.engine.channel() as channel:
            ids = await start_instances(channel, drill, len(BOUNDARIES))
        for worker in doomed:
            await wait_for(lambda w=worker: not w.running, f"{worker.name} killed at its boundary", 90)
        stack.add_worker("survivor", concurrency=len(BOUNDARIES), lease_ms=LEASE_MS)

        channel = stack.engine.channel()
        try:
            resolved = 0
            if idempotency == "none":
                # Only the write caught between send and journal is unknown; the rest go on by themselves.
                resolved = await wait_for(
                    lambda: _resolve_unknown_writes(channel, crm), "the unknown write's incident", 60, 0.3
                )
            stuck = await wait_until_finished(lambda: channel, ids, timeout=90)
        finally:
            await channel.close()
        outcome = judge(crm, gemini_url, drill, ids, stuck)
        print(f"\nfault {drill}: {outcome.summary()} incidents_resolved={resolved}")
        assert not stuck, stack.logs()
        outcome.assert_clean()
        assert resolved == (1 if idempotency == "none" else 0)

        # Nothing in clear at rest: tool arguments, tool results, model turns (their function-call
        # arguments) and the tool server's secret appear nowhere in the engine's tables.
        leaks = await plaintexts_at_rest(
            shared_database,
            {
                "tool arguments / model turn": TOOL_ARGUMENT_MARKER.strip(),
                "tool result": TOOL_RESULT_MARKER,
                "tool result given by a person": OPERATOR_RESULT_MARKER,
                "secret": crm.token,
            },
        )
        assert leaks == {}, leaks
