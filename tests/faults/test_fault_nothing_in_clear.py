"""Nothing in clear at rest, whatever path an instance took: a pg_dump of the engine's database is
searched for the known plaintext of tool arguments, tool results, model turns and the tool secret.

One stack of real processes (engine, broker, CRM, scripted Gemini, workers), Alice's bundle with an
unkeyed write and a review route, and instances that go every way:
- the happy path, to notify_customer;
- a route: an answer below the confidence threshold goes to a person's review task;
- a crash between a write's send and its journal entry, twice (a real worker SIGKILLed there): both
  held as TOOL_OUTCOME_UNKNOWN; one resolved "it did not happen" (the write is made again), the other by
  cancelling the instance;
- a tool server whose contract changed (TOOL_CONTRACT_MISMATCH incident), resolved by RETRY once the
  server is back to its contract.
The keyed and unkeyed crashes at every step boundary, with an incident resolved "it happened" with
its result, are scanned the same way in test_fault_worker_killed.py.
"""

from __future__ import annotations

import copy

from abada.engine.v1 import incident_pb2, incident_pb2_grpc, process_pb2, process_pb2_grpc
from fault_stack import (
    TOOL_ARGUMENT_MARKER,
    TOOL_RESULT_MARKER,
    alice_script,
    plaintexts_at_rest,
    running_stack,
    start_instances,
    wait_for,
)
from scripted_gemini.testing import load_script

LEASE_MS = 2_000
ROUTED = "[route to review]"
UNKNOWN = "TOOL_OUTCOME_UNKNOWN"
MISMATCH = "TOOL_CONTRACT_MISMATCH"


def script_with_a_routed_answer() -> dict:  # type: ignore[type-arg]
    """Alice's script, and for a message carrying ROUTED the same turns ending on a confidence of 20."""
    [alice] = alice_script()["scripts"]
    routed = copy.deepcopy(alice)
    routed["name"] = "routed"
    routed["match"] = {"input_contains": ROUTED}
    routed["turns"][-1]["json"]["_confidence"] = 20
    return {"scripts": [routed, alice]}


async def test_no_tool_argument_result_model_turn_or_secret_is_at_rest_in_clear_on_any_path(
    tmp_path, shared_database, crm, gemini_url
):
    crm.set_variant("standard")
    async with running_stack(
        tmp_path, shared_database, crm, gemini_url, idempotency="none", review_route=True
    ) as stack:
        load_script(gemini_url, script_with_a_routed_answer())
        channel = stack.engine.channel()
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        incidents = incident_pb2_grpc.IncidentServiceStub(channel)

        async def instance(instance_id: str) -> process_pb2.Instance:
            reply = await processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
            return reply.instance

        async def open_incidents(incident_type: str) -> list[incident_pb2.Incident]:
            listed = await incidents.ListIncidents(
                incident_pb2.ListIncidentsRequest(type=incident_type, state=incident_pb2.INCIDENT_STATE_OPEN)
            )
            return list(listed.incidents)

        try:
            # Two unkeyed writes caught between send and journal, each by a worker that dies there.
            crashed = []
            for case in ("did-not-happen", "cancelled"):
                doomed = stack.add_worker(
                    f"doomed-{case}",
                    extra={"ABADA_WORKER_FAULT": "kill-after-send:crm/create_ticket"},
                    concurrency=1,
                    lease_ms=LEASE_MS,
                )
                crashed += await start_instances(channel, f"at-rest {case}", 1)
                await wait_for(lambda w=doomed: not w.running, f"{doomed.name} killed after the send", 90)

            # The tool server's contract changes under a new instance: an incident, not a retry loop.
            crm.set_variant("no-create-ticket")
            [retried] = await start_instances(channel, "at-rest retried", 1)
            stack.add_worker("survivor", concurrency=4, lease_ms=LEASE_MS)
            unknown = await wait_for(
                lambda: _when(open_incidents(UNKNOWN), 2), "both unknown writes held for a person", 90
            )
            [mismatch] = await wait_for(
                lambda: _when(open_incidents(MISMATCH), 1), "the contract incident", 90
            )
            crm.set_variant("standard")

            by_instance = {incident.instance_id: incident for incident in unknown}
            await incidents.ResolveIncident(
                incident_pb2.ResolveIncidentRequest(
                    incident_id=by_instance[crashed[0]].id,
                    resolution=incident_pb2.RESOLUTION_DID_NOT_HAPPEN,
                    comment="no ticket in the CRM",
                )
            )
            await incidents.ResolveIncident(
                incident_pb2.ResolveIncidentRequest(
                    incident_id=by_instance[crashed[1]].id,
                    resolution=incident_pb2.RESOLUTION_CANCEL_INSTANCE,
                    comment="the customer withdrew",
                )
            )
            await incidents.ResolveIncident(
                incident_pb2.ResolveIncidentRequest(
                    incident_id=mismatch.id, resolution=incident_pb2.RESOLUTION_RETRY, comment="CRM fixed"
                )
            )
            [happy] = await start_instances(channel, "at-rest happy", 1)
            [routed] = await start_instances(channel, f"at-rest {ROUTED}", 1)

            async def where_they_are() -> dict[str, str]:
                found = {i: await instance(i) for i in (happy, routed, retried, *crashed)}
                return {
                    i: "canceled" if f.state == process_pb2.INSTANCE_STATE_CANCELED else f.current_node_id
                    for i, f in found.items()
                }

            expected = {
                happy: "notify_customer",
                routed: "review",
                retried: "notify_customer",
                crashed[0]: "notify_customer",
                crashed[1]: "canceled",
            }
            await wait_for(
                lambda: _when_equal(where_they_are(), expected), "every instance where its path leads", 120
            )
        finally:
            await channel.close()

        leaks = await plaintexts_at_rest(
            shared_database,
            {
                "tool arguments / model turn": TOOL_ARGUMENT_MARKER.strip(),
                "tool result": TOOL_RESULT_MARKER,
                "secret": crm.token,
            },
        )
        assert leaks == {}, leaks


async def _when(listing, count: int):  # type: ignore[no-untyped-def]
    found = await listing
    return found if len(found) >= count else None


async def _when_equal(reading, expected) -> bool:  # type: ignore[no-untyped-def]
    return await reading == expected
