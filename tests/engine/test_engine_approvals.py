"""Approvals at the engine: parking a task, deciding its calls, timeouts, and who may decide."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from abada.engine.v1 import approval_pb2 as ap
from abada.engine.v1 import approval_pb2_grpc, incident_pb2, process_pb2
from abada.engine.v1 import external_task_pb2 as et
from bearer import BearerToken
from engine_helpers import append, deploy, error_info, fetch, instance, journal, plain, struct, verify_lease

BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      get_customer:  {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: key, approval: required }}
processes:
  - id: guarded_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Look up ${{customerId}} and open a ticket.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        limits: {{ max_model_calls: 4, max_tool_calls: 4, max_tokens: 10000 }}
        on_invalid_output: review
        {timeout}
        next: done
      - {{ id: review, type: user_task, next: done }}
      - {{ id: done, type: end }}
"""
PROPOSED = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}
CREATE = "crm/create_ticket"


def call_request(call_id: str, arguments: dict, text: str = "") -> dict:
    request = {"callId": call_id, "name": "crm__create_ticket", "arguments": arguments}
    if text:
        request["modelText"] = text
    return request


async def proposing_task(engine, crm, timeout: str = "", calls: int = 1, business_key: str = ""):
    """A task whose model asked for `calls` create_ticket calls, each journaled AWAITING_APPROVAL."""
    await deploy(engine, BUNDLE.format(url=crm.url, timeout=timeout))
    request = process_pb2.StartInstanceRequest(
        process_id="guarded_triage", variables=struct({"customerId": "C-42"}), business_key=business_key
    )
    started = (await engine.processes.StartInstance(request)).instance
    [task] = await fetch(engine, "w", "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    function_calls = [
        {"id": f"call_{n}", "name": "crm__create_ticket", "args": PROPOSED} for n in range(calls)
    ]
    await append(
        engine,
        task,
        1,
        "MODEL_CALL",
        "COMPLETED",
        response={"text": "I will open a ticket.", "functionCalls": function_calls},
        tokens=(10, 5),
    )
    for n in range(calls):
        await append(
            engine,
            task,
            2 + n,
            "TOOL_CALL",
            "AWAITING_APPROVAL",
            tool_ref=CREATE,
            request=call_request(f"call_{n}", PROPOSED, "I will open a ticket."),
        )
    return started, task


async def park(engine, task) -> list[str]:
    reply = await engine.tasks.AwaitApproval(
        et.AwaitApprovalRequest(task_id=task.id, worker_id="w", lease_token=task.lease_token)
    )
    return list(reply.approval_ids)


async def decide(engine, approval_id: str, decision: str, comment: str = "", arguments=None) -> ap.Approval:
    request = ap.DecideApprovalRequest(
        approval_id=approval_id,
        decision=getattr(ap, f"APPROVAL_DECISION_{decision}"),
        comment=comment,
    )
    if arguments is not None:
        request.arguments.CopyFrom(struct(arguments))
    return (await engine.approvals.DecideApproval(request)).approval


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value.code(), error_info(caught.value).reason


async def test_the_binding_carries_approval_frozen_with_the_version(engine, crm, crm_credentials) -> None:
    deployed = await deploy(engine, BUNDLE.format(url=crm.url, timeout=""))
    bindings = {b.tool: b.approval_required for b in deployed.definitions[0].tool_bindings}
    assert bindings == {"get_customer": False, "create_ticket": True}


async def test_a_bad_approval_setting_is_refused_with_its_line(engine, crm, crm_credentials) -> None:
    bad = BUNDLE.format(url=crm.url, timeout="approval_timeout: soon").replace(
        "approval: required", "approval: maybe"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bad)
    message = caught.value.details()
    assert "approval" in message
    from engine_helpers import bad_request

    problems = bad_request(caught.value)
    assert any("'maybe' is not required or none" in p for p in problems)
    assert any("approval_timeout" in p and "ISO-8601" in p for p in problems)


async def test_a_call_under_approval_parks_the_task_and_cannot_run_unapproved(
    engine, crm, crm_credentials
) -> None:
    started, task = await proposing_task(engine, crm, business_key="C-42/parcel")

    # Running it without an approval is refused, whatever the worker claims.
    code, reason = await refused(
        append(
            engine, task, 3, "TOOL_CALL", "STARTED", tool_ref=CREATE, request=call_request("call_0", PROPOSED)
        )
    )
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_REQUIRED")
    # A tool without approval cannot be proposed.
    code, reason = await refused(
        append(
            engine,
            task,
            3,
            "TOOL_CALL",
            "AWAITING_APPROVAL",
            tool_ref="crm/get_customer",
            request={"callId": "x"},
        )
    )
    assert reason == "APPROVAL_NOT_REQUIRED"

    [approval_id] = await park(engine, task)

    # Parked: the old lease is worth nothing (so the broker issues no credential), nothing is fetchable.
    lease_check = verify_lease(engine, task)
    code, reason = await refused(lease_check)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert await fetch(engine, "w", "abada:agent") == []

    listed = (
        await engine.approvals.ListApprovals(ap.ListApprovalsRequest(business_key="C-42/parcel"))
    ).approvals
    assert [a.id for a in listed] == [approval_id]
    shown = listed[0]
    assert (shown.state, shown.tool_ref, shown.process_id, shown.node_id, shown.sequence) == (
        ap.APPROVAL_STATE_PENDING,
        CREATE,
        "guarded_triage",
        "triage",
        2,
    )
    assert (shown.instance_id, shown.task_id, shown.business_key) == (started.id, task.id, "C-42/parcel")
    assert plain(shown.arguments) == PROPOSED
    assert shown.model_text == "I will open a ticket."
    assert shown.HasField("create_time") and not shown.HasField("expire_time")
    for other in (
        ap.ListApprovalsRequest(process_id="other"),
        ap.ListApprovalsRequest(tool_ref="crm/get_customer"),
        ap.ListApprovalsRequest(state=ap.APPROVAL_STATE_APPROVED),
    ):
        assert list((await engine.approvals.ListApprovals(other)).approvals) == []
    # The arguments are sealed in the journal like every payload.
    steps = await journal(engine, task.id)
    assert steps[1].state == et.STEP_STATE_AWAITING_APPROVAL


async def test_approved_with_edited_arguments_only_that_call_runs_and_the_task_comes_back(
    engine, crm, crm_credentials
) -> None:
    started, task = await proposing_task(engine, crm)
    [approval_id] = await park(engine, task)
    edited = {**PROPOSED, "priority": "urgent"}

    decided = await decide(engine, approval_id, "APPROVE", "gold customer", edited)

    assert decided.state == ap.APPROVAL_STATE_APPROVED
    assert (decided.decided_by, decided.comment) == ("test-suite", "gold customer")
    assert plain(decided.approved_arguments) == edited and plain(decided.arguments) == PROPOSED
    [again] = await fetch(engine, "w", "abada:agent")
    assert (again.id, again.attempt) == (task.id, 2)
    approved_step = again.steps[1]
    assert approved_step.state == et.STEP_STATE_APPROVED
    assert plain(approved_step.response)["approval"]["arguments"] == edited
    # The proposed arguments are not what was approved: refused. The approved ones run, keyed.
    _, reason = await refused(
        append(
            engine,
            again,
            3,
            "TOOL_CALL",
            "STARTED",
            tool_ref=CREATE,
            request=call_request("call_0", PROPOSED),
        )
    )
    assert reason == "APPROVAL_REQUIRED"
    reply = await append(
        engine, again, 3, "TOOL_CALL", "STARTED", tool_ref=CREATE, request=call_request("call_0", edited)
    )
    assert reply.idempotency_key
    code, reason = await refused(decide(engine, approval_id, "REJECT", "too late"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_ALREADY_DECIDED")
    history = (
        await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    ).events
    [decision] = [plain(e.data) for e in history if e.type == "APPROVAL_DECIDED"]
    assert decision["decision"] == "APPROVED" and decision["decided_by"] == "test-suite"
    assert decision["comment"] == "gold customer" and decision["arguments_edited"] is True
    assert [e.type for e in history].count("APPROVAL_REQUESTED") == 1


async def test_rejected_the_call_is_completed_with_the_reason_as_a_tool_error(
    engine, crm, crm_credentials
) -> None:
    _, task = await proposing_task(engine, crm)
    [approval_id] = await park(engine, task)

    code, reason = await refused(decide(engine, approval_id, "REJECT"))
    assert (code, reason) == (grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT")
    decided = await decide(engine, approval_id, "REJECT", "no tickets for this customer")

    assert decided.state == ap.APPROVAL_STATE_REJECTED
    [again] = await fetch(engine, "w", "abada:agent")
    step = again.steps[1]
    assert step.state == et.STEP_STATE_COMPLETED
    assert plain(step.response) == {
        "content": [{"type": "text", "text": "rejected by a person: no tickets for this customer"}],
        "isError": True,
    }


async def test_several_calls_of_one_turn_each_wait_and_the_task_returns_once_all_are_decided(
    engine, crm, crm_credentials
) -> None:
    _, task = await proposing_task(engine, crm, calls=2)
    first, second = await park(engine, task)

    await decide(engine, first, "APPROVE")
    assert await fetch(engine, "w", "abada:agent") == []
    await decide(engine, second, "REJECT", "one ticket is enough")
    [again] = await fetch(engine, "w", "abada:agent")
    assert [s.state for s in again.steps[1:]] == [et.STEP_STATE_APPROVED, et.STEP_STATE_COMPLETED]


async def test_an_approval_of_a_cancelled_instance_cannot_be_decided(engine, crm, crm_credentials) -> None:
    started, task = await proposing_task(engine, crm)
    [approval_id] = await park(engine, task)
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=started.id, reason="duplicate")
    )

    code, reason = await refused(decide(engine, approval_id, "APPROVE"))

    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "INSTANCE_NOT_ACTIVE")
    got = (await engine.approvals.GetApproval(ap.GetApprovalRequest(approval_id=approval_id))).approval
    assert got.state == ap.APPROVAL_STATE_CANCELED


async def test_approvers_and_operators_decide_workers_may_not(
    engine, crm, crm_credentials, engine_tokens
) -> None:
    _, task = await proposing_task(engine, crm, calls=2)
    first, second = await park(engine, task)
    address = engine.address

    async def decide_as(token: str, approval_id: str) -> ap.Approval:
        async with grpc.aio.insecure_channel(address, interceptors=[BearerToken(token)]) as channel:
            stub = approval_pb2_grpc.ApprovalServiceStub(channel)
            request = ap.DecideApprovalRequest(approval_id=approval_id, decision=ap.APPROVAL_DECISION_APPROVE)
            return (await stub.DecideApproval(request)).approval

    code, reason = await refused(decide_as(engine_tokens.worker_pool, first))
    assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "ROLE_REQUIRED")
    assert (await decide_as(engine_tokens.approver, first)).decided_by == "carol"
    assert (await decide_as(engine_tokens.operator, second)).decided_by == "ops"


async def wait_for(condition, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        value = await condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


async def test_past_the_approval_timeout_the_token_takes_its_route(engine, crm, crm_credentials) -> None:
    started, task = await proposing_task(
        engine, crm, timeout="approval_timeout: PT1S\n        on_approval_timeout: review"
    )
    [approval_id] = await park(engine, task)

    async def moved():  # type: ignore[no-untyped-def]
        found = await instance(engine, started.id)
        return found if found.current_node_id == "review" else None

    await wait_for(moved)
    got = (await engine.approvals.GetApproval(ap.GetApprovalRequest(approval_id=approval_id))).approval
    assert got.state == ap.APPROVAL_STATE_EXPIRED and got.HasField("expire_time")
    code, reason = await refused(decide(engine, approval_id, "APPROVE"))
    assert (code, reason) == (grpc.StatusCode.FAILED_PRECONDITION, "APPROVAL_EXPIRED")
    history = (
        await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    ).events
    assert "APPROVAL_TIMED_OUT" in [e.type for e in history]


async def test_past_the_approval_timeout_without_a_route_an_incident_asks_a_person(
    engine, crm, crm_credentials
) -> None:
    started, task = await proposing_task(engine, crm, timeout="approval_timeout: PT1S")
    [approval_id] = await park(engine, task)

    async def raised():  # type: ignore[no-untyped-def]
        found = await engine.incidents.ListIncidents(
            incident_pb2.ListIncidentsRequest(instance_id=started.id)
        )
        return list(found.incidents)

    [incident] = await wait_for(raised)
    assert incident.type == "APPROVAL_TIMEOUT" and incident.task_id == task.id
    # Retry asks again: the approval is pending once more and can be decided.
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY)
    )
    got = (await engine.approvals.GetApproval(ap.GetApprovalRequest(approval_id=approval_id))).approval
    assert got.state == ap.APPROVAL_STATE_PENDING
    assert (await decide(engine, approval_id, "APPROVE")).state == ap.APPROVAL_STATE_APPROVED
    [again] = await fetch(engine, "w", "abada:agent")
    assert again.id == task.id
