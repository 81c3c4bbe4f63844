"""`abada approvals`, `abada approve` and `abada reject` on calls a worker proposed through the API."""

from __future__ import annotations

from approval_helpers import parked_with_proposed_calls
from cli_support import abada
from crm_mcp.testing import RunningCrmServer


async def two_proposed_calls(engine, crm: RunningCrmServer, deploy_credentials) -> tuple[str, list[str]]:  # type: ignore[no-untyped-def]
    """An instance (business key C-42/parcel) whose model asked for two tickets, both awaiting a person."""
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    return await parked_with_proposed_calls(engine, crm.url)


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
    assert rejected.json()["approval"]["state"] == "rejected"

    twice = await abada(engine.address, "approve", second)
    assert twice.exit_code != 0
    assert "APPROVAL_ALREADY_DECIDED" in twice.stderr and "rejected by test-suite" in twice.stderr

    decided = (await abada(engine.address, "approvals", "--state", "approved", "--json")).json()
    assert [(a["id"], a["decidedBy"], a["comment"]) for a in decided["approvals"]] == [
        (first, "test-suite", "gold customer")
    ]
    shown = await abada(engine.address, "show", instance_id)
    assert shown.stdout.count("APPROVAL_DECIDED") == 2
