"""`abada approvals`, `abada approve` and `abada reject` on calls a worker proposed through the API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from cli_support import abada, fetch_one
from crm_mcp.testing import RunningCrmServer, running_crm_server
from engine_helpers import append, deploy, struct

BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      create_ticket: {{ policy: write, idempotency: key, approval: required }}
processes:
  - id: guarded_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Open a ticket for ${{customerId}}.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/create_ticket]
        result_variable: triage
        next: done
      - {{ id: done, type: end }}
"""
PROPOSED = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


@pytest.fixture(scope="module")
def crm() -> Iterator[RunningCrmServer]:
    with running_crm_server() as server:
        yield server


async def two_proposed_calls(engine, crm: RunningCrmServer, deploy_credentials) -> tuple[str, list[str]]:  # type: ignore[no-untyped-def]
    """An instance (business key C-42/parcel) whose model asked for two tickets, both awaiting a person."""
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    await deploy(engine, BUNDLE.format(url=crm.url))
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="guarded_triage", variables=struct({"customerId": "C-42"}), business_key="C-42/parcel"
        )
    )
    task = await fetch_one(engine, "abada:agent")
    worker = "cli-test-worker"
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id=worker)
    calls = [{"id": f"c{n}", "name": "crm__create_ticket", "args": PROPOSED} for n in (1, 2)]
    await append(
        engine,
        task,
        1,
        "MODEL_CALL",
        "COMPLETED",
        response={"text": "Opening a ticket.", "functionCalls": calls},
        worker_id=worker,
    )
    for n in (1, 2):
        await append(
            engine,
            task,
            1 + n,
            "TOOL_CALL",
            "AWAITING_APPROVAL",
            tool_ref="crm/create_ticket",
            request={
                "callId": f"c{n}",
                "name": "crm__create_ticket",
                "arguments": PROPOSED,
                "modelText": "Opening a ticket.",
            },
            worker_id=worker,
        )
    parked = await engine.tasks.AwaitApproval(
        external_task_pb2.AwaitApprovalRequest(
            task_id=task.id, worker_id=worker, lease_token=task.lease_token
        )
    )
    return started.instance.id, list(parked.approval_ids)


async def test_approvals_lists_what_a_person_must_decide(engine, crm, deploy_credentials) -> None:
    instance_id, (first, second) = await two_proposed_calls(engine, crm, deploy_credentials)

    ran = await abada(engine.address, "approvals", "--business-key", "C-42/parcel")

    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout.count("approval ") == 2
    for approval_id in (first, second):
        assert f"abada approve {approval_id}" in ran.stdout
    assert ran.stdout.count("crm/create_ticket") == 2
    assert "model said" in ran.stdout and "Opening a ticket." in ran.stdout
    assert '"subject": "Parcel not received"' in ran.stdout
    assert instance_id in ran.stdout
    listed = (await abada(engine.address, "approvals", "--tool", "crm/create_ticket", "--json")).json()
    assert [a["id"] for a in listed["approvals"]] == [first, second]
    assert (
        await abada(engine.address, "approvals", "--process", "other")
    ).stdout.strip() == "no pending approvals"


async def test_approve_with_edited_args_then_reject_and_deciding_twice_is_refused(
    engine, crm, deploy_credentials
) -> None:
    instance_id, (first, second) = await two_proposed_calls(engine, crm, deploy_credentials)

    approved = await abada(
        engine.address,
        "approve",
        first,
        "--args",
        '{"customerId": "C-42", "subject": "Lost parcel", "priority": "urgent"}',
        "--comment",
        "gold customer",
    )
    assert approved.exit_code == 0, approved.stderr
    assert approved.stdout.startswith("approved\n")
    assert '"priority": "urgent"' in approved.stdout and "gold customer" in approved.stdout

    no_reason = await abada(engine.address, "reject", second, "--reason", "  ")
    assert no_reason.exit_code != 0 and "--reason must say why" in no_reason.stderr
    rejected = await abada(engine.address, "reject", second, "--reason", "one ticket is enough", "--json")
    assert rejected.exit_code == 0, rejected.stderr
    assert rejected.json()["approval"]["state"] == "APPROVAL_STATE_REJECTED"

    twice = await abada(engine.address, "approve", second)
    assert twice.exit_code != 0
    assert "APPROVAL_ALREADY_DECIDED" in twice.stderr and "rejected by test-suite" in twice.stderr

    decided = (await abada(engine.address, "approvals", "--state", "approved", "--json")).json()
    assert [(a["id"], a["decidedBy"], a["comment"]) for a in decided["approvals"]] == [
        (first, "test-suite", "gold customer")
    ]
    shown = await abada(engine.address, "show", instance_id)
    assert shown.stdout.count("APPROVAL_DECIDED") == 2
