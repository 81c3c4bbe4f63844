"""`abada incidents` and `abada resolve` on an incident produced through the API."""

from __future__ import annotations

import json
import time

from abada.engine.v1 import external_task_pb2, incident_pb2
from abada_engine.cli import views
from cli_support import abada, fetch_one
from engine_helpers import append, deploy, fetch, start, struct

NOTIFY = """
processes:
  - id: notify
    start: send
    nodes:
      - { id: send, type: service, topic: notify, next: done }
      - { id: done, type: end }
"""


async def failed_instance(engine) -> tuple[str, str, str]:
    """An instance whose service task failed for good: (instance id, task id, incident id)."""
    await deploy(engine, NOTIFY)
    instance = await start(engine, "notify", customerId="C-42")
    task = await fetch_one(engine, "notify")
    failed = await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="cli-test-worker",
            lease_token=task.lease_token,
            error_code="SMTP_REFUSED",
            error_message="the mail relay refused the message",
            error_details=struct({"relay": "smtp.acme.internal"}),
            no_retry=True,
        )
    )
    assert failed.incident_id
    return instance.id, task.id, failed.incident_id


async def test_incidents_lists_an_open_incident(engine):
    instance_id, task_id, incident_id = await failed_instance(engine)
    ran = await abada(engine.address, "incidents")
    assert ran.exit_code == 0, ran.stderr
    header, row = ran.stdout.splitlines()
    assert header.split() == ["ID", "TYPE", "INSTANCE", "TASK", "NODE", "AGE", "MESSAGE"]
    cells = row.split()
    assert cells[:5] == [incident_id, "SMTP_REFUSED", instance_id, task_id, "send"]
    assert cells[5].endswith("s")
    assert row.endswith("the mail relay refused the message")


async def test_incidents_filters_and_json(engine):
    instance_id, task_id, incident_id = await failed_instance(engine)
    ran = await abada(engine.address, "incidents", "--instance", instance_id, "--json")
    listed = ran.json()
    assert [(i["id"], i["taskId"], i["state"]) for i in listed["incidents"]] == [
        (incident_id, task_id, "open")
    ]
    assert "smtp.acme.internal" in json.dumps(listed["incidents"][0]["details"])
    other_type = await abada(engine.address, "incidents", "--type", "TOOL_OUTCOME_UNKNOWN")
    assert other_type.stdout.strip() == "no incidents"


async def test_resolve_retry_offers_the_task_again(engine):
    _, task_id, incident_id = await failed_instance(engine)
    ran = await abada(engine.address, "resolve", incident_id, "--retry", "--comment", "relay fixed")
    assert ran.exit_code == 0, ran.stderr
    assert "RESOLVED" in ran.stdout and "RETRY" in ran.stdout

    assert (await abada(engine.address, "incidents")).stdout.strip() == "no incidents"
    everything = await abada(engine.address, "incidents", "--all")
    header, row = everything.stdout.splitlines()
    assert "STATE" in header.split() and "RESOLUTION" in header.split()
    cells = row.split()
    assert (cells[0], cells[1], cells[3], cells[4], cells[6], cells[7]) == (
        incident_id,
        "SMTP_REFUSED",
        task_id,
        "send",
        "RESOLVED",
        "RETRY",
    )

    again = await fetch_one(engine, "notify")
    assert again.id == task_id


async def test_resolving_twice_is_refused_with_the_reason(engine):
    _, _, incident_id = await failed_instance(engine)
    assert (await abada(engine.address, "resolve", incident_id, "--cancel")).exit_code == 0
    twice = await abada(engine.address, "resolve", incident_id, "--retry")
    assert twice.exit_code == 1
    assert twice.stderr.startswith("error: INCIDENT_RESOLVED: ")


async def test_resolve_needs_exactly_one_decision(engine):
    _, _, incident_id = await failed_instance(engine)
    for args in ([], ["--retry", "--cancel"], ["--happened"], ["--retry", "--result", "{}"]):
        ran = await abada(engine.address, "resolve", incident_id, *args)
        assert ran.exit_code == 2, args
        assert ran.stderr.startswith("error: "), args
    bad_result = await abada(engine.address, "resolve", incident_id, "--happened", "--result", "{not json")
    assert bad_result.exit_code == 2
    assert "--result: not valid JSON" in bad_result.stderr
    still_open = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())
    assert [i.id for i in still_open.incidents] == [incident_id]


async def test_resolve_json_returns_the_incident(engine):
    _, _, incident_id = await failed_instance(engine)
    ran = await abada(engine.address, "resolve", incident_id, "--cancel", "--json")
    resolved = ran.json()["incident"]
    assert (resolved["id"], resolved["state"], resolved["resolution"]) == (
        incident_id,
        "resolved",
        "CANCEL_INSTANCE",
    )


def test_outcome_unknown_incident_shows_what_is_known_about_the_call():
    incident = incident_pb2.Incident(
        id="inc-1",
        type="TOOL_OUTCOME_UNKNOWN",
        instance_id="inst-1",
        node_id="triage",
        message="crm/create_ticket was STARTED but never confirmed",
        details=struct(
            {
                "started_at": "2025-01-01T10:00:00Z",
                "tool_ref": "crm/create_ticket",
                # The shape the engine writes (see the test below, fed a real incident).
                "request": {"callId": "call_2", "arguments": {"customerId": "C-42", "priority": "high"}},
                "idempotency": "none",
                "sequence": 4,
            }
        ),
        state=incident_pb2.INCIDENT_STATE_OPEN,
    )
    text = views.incidents_table([incident], with_state=False)
    block = text.split("\n\n", 1)[1].splitlines()
    assert block[0] == "incident inc-1: did this call happen?"
    keys = [line.split()[0] for line in block[1:] if line.startswith("  ") and not line.startswith("    ")]
    assert keys[:4] == ["tool_ref", "arguments", "idempotency", "started_at"]
    assert "  tool_ref     crm/create_ticket" in block
    assert '"customerId": "C-42",' in text
    assert "  sequence     4" in block
    assert block[-1].startswith("  decide with: abada resolve inc-1 --happened --result")


UNKEYED_WRITE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      create_ticket: {{ policy: write, idempotency: none }}
processes:
  - id: ticketing
    start: open
    nodes:
      - id: open
        type: agent
        model: gemini-m
        prompt: Open a ticket.
        tools: [crm/create_ticket]
        result_variable: ticket
        next: done
      - {{ id: done, type: end }}
"""


async def test_the_incident_card_of_a_real_outcome_unknown_incident_leads_with_the_call(
    engine, crm, deploy_credentials
):
    """Fed what the engine itself writes (not a hand-built incident): a write started, its worker gone."""
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    await deploy(engine, UNKEYED_WRITE.format(url=crm.url))
    await start(engine, "ticketing")
    [task] = await fetch(engine, "cli-test-worker", "abada:agent", lease_ms=1_000)
    write = {"callId": "call_7", "arguments": {"customerId": "C-42", "subject": "Parcel not received"}}
    await append(
        engine,
        task,
        1,
        "TOOL_CALL",
        "STARTED",
        "crm/create_ticket",
        request=write,
        worker_id="cli-test-worker",
    )
    deadline = time.monotonic() + 20
    incidents: list[incident_pb2.Incident] = []
    while time.monotonic() < deadline and not incidents:
        await fetch(engine, "cli-test-worker-2", "abada:agent", wait_ms=200)  # a takeover finds it too
        listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())
        incidents = [i for i in listed.incidents if i.type == "TOOL_OUTCOME_UNKNOWN"]
    [incident] = incidents

    ran = await abada(engine.address, "incidents")
    assert ran.exit_code == 0, ran.stderr
    block = ran.stdout.split("\n\n", 1)[1].splitlines()
    assert block[0] == f"incident {incident.id}: did this call happen?"
    keys = [line.split()[0] for line in block[1:] if line.startswith("  ") and not line.startswith("    ")]
    assert keys[:4] == ["tool_ref", "arguments", "idempotency", "started_at"]
    assert "  tool_ref     crm/create_ticket" in block
    assert '"subject": "Parcel not received"' in ran.stdout
    assert "  call_id      call_7" in block
    assert "  sequence     1" in block
