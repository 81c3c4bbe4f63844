"""A person approves a tool call before it runs: Alice's scenario with create_ticket under approval.

Real processes: the engine over gRPC, the credential broker and the agent worker as subprocesses,
the demo CRM over MCP streamable-http, the scripted Gemini endpoint behind the real google-genai
client. The task parks while a person decides; the model is never paid twice for a turn.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import grpc
import pytest
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada.engine.v1 import approval_pb2 as ap
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from abada_common.struct_codec import from_struct
from bearer import BearerToken
from crm_mcp.testing import RunningCrmServer
from engine_helpers import append, error_info, fetch, struct, support_triage
from google.protobuf import json_format
from scripted_gemini.testing import fetch_calls
from test_worker_e2e import POOL, journal, settled, triage_task_id
from worker_process import WorkerLauncher
from worker_servers import RealBroker
from worker_support import deploy_bundle, history_of

# The reference scenario's collaborators (tests/worker/conftest.py): an empty CRM and a freshly loaded
# script for every test, the real broker, the worker launcher.
pytestmark = pytest.mark.usefixtures("crm", "gemini_url")

MODEL, TOOL = external_task_pb2.STEP_KIND_MODEL_CALL, external_task_pb2.STEP_KIND_TOOL_CALL
STATES = {
    external_task_pb2.STEP_STATE_STARTED: "STARTED",
    external_task_pb2.STEP_STATE_COMPLETED: "COMPLETED",
    external_task_pb2.STEP_STATE_AWAITING_APPROVAL: "AWAITING_APPROVAL",
    external_task_pb2.STEP_STATE_APPROVED: "APPROVED",
}
PROPOSED = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


def bundle(crm_url: str, node_extra: str = "") -> str:
    return support_triage(crm_url, approval=True, node_extra=node_extra)


def shape(steps: list[external_task_pb2.JournalStep]) -> list[tuple[int, str, str]]:
    names = {
        (MODEL, ""): "model",
        (TOOL, "crm/get_customer"): "get_customer",
        (TOOL, "crm/create_ticket"): "create_ticket",
    }
    return [(s.sequence, names[(s.kind, s.tool_ref)], STATES[s.state]) for s in steps]


async def start_alice(engine, message: str = "My parcel never arrived", customer: str = "C-42") -> str:  # type: ignore[no-untyped-def]
    request = process_pb2.StartInstanceRequest(
        process_id="support_triage",
        variables=struct({"customerId": customer, "message": message}),
        business_key=f"{customer}/parcel",
    )
    return (await engine.processes.StartInstance(request)).instance.id


async def pending_approvals(engine, count: int = 1, timeout: float = 30.0) -> list[ap.Approval]:  # type: ignore[no-untyped-def]
    """Waits until `count` approvals are pending, and returns them."""
    deadline = time.monotonic() + timeout
    while True:
        found = list((await engine.approvals.ListApprovals(ap.ListApprovalsRequest())).approvals)
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} approvals pending after {timeout}s, wanted {count}"
        await asyncio.sleep(0.1)


async def decide(
    engine, approval_id: str, decision: str, comment: str = "", arguments: dict | None = None
) -> ap.Approval:  # type: ignore[no-untyped-def]
    request = ap.DecideApprovalRequest(
        approval_id=approval_id, decision=getattr(ap, f"APPROVAL_DECISION_{decision}"), comment=comment
    )
    if arguments is not None:
        request.arguments.CopyFrom(struct(arguments))
    return (await engine.approvals.DecideApproval(request)).approval


def new_tickets(crm: RunningCrmServer) -> list[dict[str, Any]]:
    """Every ticket of this test's own CRM (each test gets a fresh one)."""
    return crm.tickets()


def model_turns(gemini_url: str) -> list[int]:
    calls = fetch_calls(gemini_url)
    assert calls["repeated"] == [], f"a model turn was paid twice: {calls['repeated']}"
    return sorted(c["turn"] for c in calls["calls"] if c["status"] == 200)


def history_data(events: list[Any], kind: str) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(e.data) for e in events if e.type == kind]


async def test_alice_waits_for_a_person_then_exactly_one_ticket_and_no_turn_paid_twice(
    engine, crm: RunningCrmServer, gemini_url: str, broker: RealBroker, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine)
    worker = await workers.start(ABADA_WORKER_ID=f"{POOL}/agent-worker-1")

    [approval] = await pending_approvals(engine)

    task_id = await triage_task_id(engine, instance_id)
    assert (approval.task_id, approval.instance_id, approval.business_key) == (
        task_id,
        instance_id,
        "C-42/parcel",
    )
    assert (approval.tool_ref, approval.node_id, approval.process_id) == (
        "crm/create_ticket",
        "triage",
        "support_triage",
    )
    assert from_struct(approval.arguments) == PROPOSED
    assert shape(await journal(engine, task_id)) == [
        (1, "model", "COMPLETED"),
        (2, "get_customer", "COMPLETED"),
        (3, "model", "COMPLETED"),
        (4, "create_ticket", "AWAITING_APPROVAL"),
    ]
    assert new_tickets(crm) == []  # nothing was sent while it waits
    assert model_turns(gemini_url) == [0, 1]
    await worker.wait_for_log("task handed back to wait for approval")

    decided = await decide(engine, approval.id, "APPROVE", "gold customer, go ahead")
    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    [ticket] = new_tickets(crm)
    triage = from_struct(done.variables)["triage"]
    assert triage["ticketId"] == ticket["ticketId"]
    assert (ticket["subject"], ticket["priority"]) == ("Parcel not received", "high")
    steps = await journal(engine, task_id)
    assert shape(steps) == [
        (1, "model", "COMPLETED"),
        (2, "get_customer", "COMPLETED"),
        (3, "model", "COMPLETED"),
        (4, "create_ticket", "APPROVED"),
        (5, "create_ticket", "COMPLETED"),
        (6, "model", "COMPLETED"),
    ]
    # The approved call ran under the usual STARTED / key / COMPLETED, in the second attempt.
    assert [s.attempt for s in steps] == [1, 1, 1, 1, 2, 2]
    assert steps[4].idempotency_key == ticket["idempotencyKey"]
    assert model_turns(gemini_url) == [0, 1, 2]
    events = await history_of(engine, instance_id)
    [decision] = history_data(events, "APPROVAL_DECIDED")
    assert (
        decision["decision"],
        decision["decidedBy"] if "decidedBy" in decision else decision["decided_by"],
    ) == (
        "APPROVED",
        "test-suite",
    )
    assert decision["comment"] == "gold customer, go ahead"
    assert decided.HasField("decide_time")
    # Both attempts got the CRM's credential under their own live lease.
    issued = [
        r for r in broker.records() if r.get("event") == "credential.issued" and r.get("task_id") == task_id
    ]
    assert sorted(r["attempt"] for r in issued) == [1, 2]


async def test_approved_with_edited_arguments_the_ticket_carries_the_edits(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine)
    await workers.start()
    [approval] = await pending_approvals(engine)
    edited = {"customerId": "C-42", "subject": "Lost parcel, order 5531 (gold)", "priority": "urgent"}

    decided = await decide(engine, approval.id, "APPROVE", "urgent: gold customer", edited)
    done = await settled(engine, instance_id)

    assert from_struct(decided.approved_arguments) == edited
    [ticket] = new_tickets(crm)
    assert (ticket["subject"], ticket["priority"]) == (edited["subject"], "urgent")
    assert from_struct(done.variables)["triage"]["ticketId"] == ticket["ticketId"]
    steps = await journal(engine, await triage_task_id(engine, instance_id))
    assert from_struct(steps[4].request)["arguments"] == edited
    assert model_turns(gemini_url) == [0, 1, 2]


async def test_rejected_no_ticket_the_model_reads_the_reason_and_its_answer_meets_the_contract(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine, message="My parcel never arrived [scripted:after-rejection]")
    await workers.start()
    [approval] = await pending_approvals(engine)

    await decide(engine, approval.id, "REJECT", "Alice already has an open ticket for order 5531")
    done = await settled(engine, instance_id)

    assert new_tickets(crm) == []
    assert done.current_node_id == "notify_customer"  # the answer passed the output contract
    triage = from_struct(done.variables)["triage"]
    assert triage == {
        "ticketId": "NONE",
        "priority": "high",
        "summary": "rejected by a person: Alice already has an open ticket for order 5531",
    }
    steps = await journal(engine, await triage_task_id(engine, instance_id))
    assert shape(steps)[3:] == [(4, "create_ticket", "COMPLETED"), (5, "model", "COMPLETED")]
    assert from_struct(steps[3].response)["isError"] is True
    assert model_turns(gemini_url) == [0, 1, 2]
    [decision] = history_data(await history_of(engine, instance_id), "APPROVAL_DECIDED")
    assert decision["decision"] == "REJECTED"


async def test_deciding_twice_is_refused_with_a_reason(
    engine, crm: RunningCrmServer, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine)
    await workers.start()
    [approval] = await pending_approvals(engine)
    await decide(engine, approval.id, "APPROVE")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await decide(engine, approval.id, "REJECT", "changed my mind")

    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(caught.value)
    assert info.reason == "APPROVAL_ALREADY_DECIDED" and info.metadata["field"] == "approval_id"
    assert "already approved by test-suite" in caught.value.details()
    await settled(engine, instance_id)
    assert len(new_tickets(crm)) == 1


async def test_a_worker_killed_right_after_proposing_the_call_loses_nothing(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine)
    doomed = await workers.start(
        ABADA_WORKER_ID=f"{POOL}/doomed", ABADA_WORKER_FAULT="kill-after-propose:crm/create_ticket"
    )

    assert await doomed.wait(timeout=30) == -signal.SIGKILL
    task_id = await triage_task_id(engine, instance_id)
    assert shape(await journal(engine, task_id))[-1] == (4, "create_ticket", "AWAITING_APPROVAL")
    # It died before handing the task back: no approval yet, the lease runs out, a successor parks it.
    assert list((await engine.approvals.ListApprovals(ap.ListApprovalsRequest())).approvals) == []
    await workers.start(ABADA_WORKER_ID=f"{POOL}/successor")
    [approval] = await pending_approvals(engine)
    assert from_struct(approval.arguments) == PROPOSED and approval.sequence == 4

    await decide(engine, approval.id, "APPROVE")
    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    assert len(new_tickets(crm)) == 1
    steps = await journal(engine, task_id)
    assert shape(steps)[3:] == [
        (4, "create_ticket", "APPROVED"),
        (5, "create_ticket", "COMPLETED"),
        (6, "model", "COMPLETED"),
    ]
    assert [s.attempt for s in steps] == [1, 1, 1, 1, 3, 3]  # attempt 2 only parked it
    assert model_turns(gemini_url) == [0, 1, 2]


async def test_two_calls_of_one_turn_are_two_approvals_and_the_model_hears_back_once_both_are_decided(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_alice(engine, message="Parcel lost, and I want a refund [scripted:two-tickets]")
    await workers.start()
    first, second = await pending_approvals(engine, count=2)
    assert [from_struct(a.arguments)["subject"] for a in (first, second)] == [
        "Refund for order 5531",
        "Parcel not received",
    ]

    await decide(engine, first.id, "REJECT", "no refund before the parcel is found")
    task_id = await triage_task_id(engine, instance_id)
    # One decided, one pending: the task stays parked, nobody may take it.
    parked = await fetch(engine, f"{POOL}/probe", "abada:agent")
    assert parked == []
    await decide(engine, second.id, "APPROVE")
    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    [ticket] = new_tickets(crm)
    assert ticket["subject"] == "Parcel not received"
    assert shape(await journal(engine, task_id))[3:] == [
        (4, "create_ticket", "COMPLETED"),  # the rejection, as the model reads it
        (5, "create_ticket", "APPROVED"),
        (6, "create_ticket", "COMPLETED"),
        (7, "model", "COMPLETED"),
    ]
    assert model_turns(gemini_url) == [0, 1, 2]


async def test_the_broker_issues_under_the_live_lease_and_refuses_the_parked_tasks_old_lease(
    engine, crm: RunningCrmServer, broker: RealBroker, engine_tokens
) -> None:  # type: ignore[no-untyped-def]
    # The test is the first worker here, so it knows the lease it presents.
    await deploy_bundle(engine, bundle(crm.url))
    await start_alice(engine)
    worker_id = f"{POOL}/by-hand"
    [task] = await fetch(engine, worker_id, "abada:agent")
    async with grpc.aio.insecure_channel(
        broker.address, interceptors=[BearerToken(engine_tokens.worker_pool)]
    ) as channel:
        stub = credential_pb2_grpc.CredentialServiceStub(channel)
        request = credential_pb2.GetToolCredentialRequest(
            task_id=task.id, worker_id=worker_id, lease_token=task.lease_token, server="crm"
        )
        issued = await stub.GetToolCredential(request, timeout=10)
        assert issued.secret == crm.token
        await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id=worker_id)
        await append(
            engine,
            task,
            1,
            "MODEL_CALL",
            "COMPLETED",
            response={"functionCalls": [{"id": "c1", "name": "crm__create_ticket", "args": PROPOSED}]},
            worker_id=worker_id,
        )
        await append(
            engine,
            task,
            2,
            "TOOL_CALL",
            "AWAITING_APPROVAL",
            tool_ref="crm/create_ticket",
            request={"callId": "c1", "name": "crm__create_ticket", "arguments": PROPOSED},
            worker_id=worker_id,
        )
        await engine.tasks.AwaitApproval(
            external_task_pb2.AwaitApprovalRequest(
                task_id=task.id, worker_id=worker_id, lease_token=task.lease_token
            )
        )

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetToolCredential(request, timeout=10)

    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert crm.token not in (caught.value.details() or "")
    refused = [
        r for r in broker.records() if r.get("event") == "credential.refused" and r.get("task_id") == task.id
    ]
    assert refused, "the broker did not audit the refusal"


@pytest.mark.parametrize("routed", [True, False], ids=["route", "incident"])
async def test_nobody_decides_in_time_the_token_takes_its_route_or_an_incident_asks(
    engine, crm: RunningCrmServer, workers: WorkerLauncher, routed: bool
) -> None:
    extra = "approval_timeout: PT1S" + ("\n        on_approval_timeout: review" if routed else "")
    await deploy_bundle(engine, bundle(crm.url, extra))
    instance_id = await start_alice(engine)
    await workers.start()

    done = await settled(engine, instance_id)

    [approval] = list(
        (
            await engine.approvals.ListApprovals(ap.ListApprovalsRequest(state=ap.APPROVAL_STATE_EXPIRED))
        ).approvals
    )
    assert approval.tool_ref == "crm/create_ticket"
    assert new_tickets(crm) == []
    events = await history_of(engine, instance_id)
    assert history_data(events, "APPROVAL_TIMED_OUT")
    if routed:
        assert done.current_node_id == "review"
    else:
        assert done.current_node_id == "triage"
        found = await engine.incidents.ListIncidents(
            incident_pb2.ListIncidentsRequest(instance_id=instance_id)
        )
        [incident] = found.incidents
        assert incident.type == "APPROVAL_TIMEOUT"
        assert "approval_timeout" in incident.message
