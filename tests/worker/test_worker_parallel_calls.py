"""A model turn asking for several calls: they run together, journaled in call order, answered in call order.

Real processes: the engine, the credential broker, the demo CRM (its lookups slowed down so that
overlap is visible, and every call's start and end recorded), the scripted Gemini endpoint and
worker processes; a SIGKILL in the middle of the batch.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
from abada_common.struct_codec import from_struct
from crm_mcp.testing import RunningCrmServer
from scripted_gemini.testing import fetch_calls, load_script
from test_worker_e2e import (
    COMPLETED,
    POOL,
    STARTED,
    bundle,
    journal,
    settled,
    shape,
    tickets_of,
    triage_task_id,
)
from worker_process import WorkerLauncher
from worker_support import deploy_bundle, start_instance

READ_LATENCY_MS = 800

# One turn asks for two lookups and a ticket at once; the answer quotes the ticket.
TWO_READS_AND_A_WRITE = {
    "scripts": [
        {
            "name": "batch",
            "turns": [
                {
                    "calls": [
                        {"name": "crm__get_customer", "args": {"customerId": "{{input.customerId}}"}},
                        {"name": "crm__get_customer", "args": {"customerId": "C-7"}},
                        {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": "{{input.customerId}}",
                                "subject": "Parcel not received",
                                "priority": "high",
                            },
                        },
                    ]
                },
                {
                    "json": {
                        "ticketId": "{{tool.crm__create_ticket.ticketId}}",
                        "priority": "high",
                        "_confidence": 95,
                    }
                },
            ],
        }
    ]
}


# The collaborators are tests/worker/conftest.py's: here the CRM's lookups are slowed down and the
# script asks for three calls in one turn.
pytestmark = pytest.mark.usefixtures("crm", "gemini_url")


@pytest.fixture
def crm_read_latency_ms() -> int:
    return READ_LATENCY_MS


@pytest.fixture
def model_script() -> dict[str, Any]:
    return TWO_READS_AND_A_WRITE


@pytest.fixture
def worker_settings() -> dict[str, str]:
    return {"ABADA_WORKER_ID": f"{POOL}/parallel", "ABADA_TOOL_CALL_CONCURRENCY": "4"}


def calls_for(crm: RunningCrmServer, since: float) -> list[dict[str, Any]]:
    return [call for call in crm.calls() if call["started"] >= since]


def overlap(calls: list[dict[str, Any]]) -> bool:
    """All of them were running at one moment: the last to begin began before the first to end ended."""
    return max(call["started"] for call in calls) < min(call["finished"] for call in calls)


async def test_two_reads_and_a_write_run_together_journaled_and_answered_in_call_order(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    begun = max((call["started"] for call in crm.calls()), default=0.0)
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Parcel missing")
    await workers.start()

    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    calls = calls_for(crm, begun)
    assert [(c["tool"], c["arguments"]["customerId"]) for c in calls if c["tool"] == "get_customer"] in (
        [("get_customer", "C-42"), ("get_customer", "C-7")],
        [("get_customer", "C-7"), ("get_customer", "C-42")],
    )
    assert len(calls) == 3 and overlap(calls), calls  # the CRM saw all three at once
    steps = await journal(engine, await triage_task_id(engine, instance_id))
    # Three steps, one sequence each, in the order the model asked for them.
    assert shape(steps) == [
        (1, "model", COMPLETED),
        (2, "get_customer", COMPLETED),
        (3, "get_customer", COMPLETED),
        (4, "create_ticket", COMPLETED),
        (5, "model", COMPLETED),
    ]
    assert [from_struct(s.request)["arguments"]["customerId"] for s in steps[1:4]] == ["C-42", "C-7", "C-42"]
    assert [from_struct(s.request)["callId"] for s in steps[1:4]] == ["call_0_0", "call_0_1", "call_0_2"]
    assert from_struct(steps[1].response)["structuredContent"]["customerId"] == "C-42"
    assert from_struct(steps[2].response)["structuredContent"]["customerId"] == "C-7"
    # The ticket was created long before the slow lookups ended, yet the model read the results in
    # the order it asked for them.
    second_turn = [c for c in fetch_calls(gemini_url)["calls"] if c["turn"] == 1]
    assert [c["function_responses"] for c in second_turn] == [
        ["crm__get_customer", "crm__get_customer", "crm__create_ticket"]
    ]
    (ticket,) = [t for t in tickets_of(crm) if t["idempotencyKey"] == steps[3].idempotency_key]
    assert from_struct(done.variables)["triage"]["ticketId"] == ticket["ticketId"]


async def test_a_worker_killed_mid_batch_leaves_one_ticket_and_no_model_turn_played_twice(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url))
    customer = "C-108"
    instance_id = await start_instance(
        engine, "support_triage", customerId=customer, message="Broken grinder"
    )
    # Killed as soon as the ticket's answer arrives: the two slow lookups are still running.
    doomed = await workers.start(
        ABADA_WORKER_ID=f"{POOL}/doomed", ABADA_WORKER_FAULT="kill-after-send:crm/create_ticket"
    )

    assert await doomed.wait(timeout=30) == -signal.SIGKILL
    task_id = await triage_task_id(engine, instance_id)
    assert shape(await journal(engine, task_id)) == [
        (1, "model", COMPLETED),
        (2, "get_customer", STARTED),
        (3, "get_customer", STARTED),
        (4, "create_ticket", STARTED),
    ]
    (ticket,) = tickets_of(crm, customer)

    await workers.start(ABADA_WORKER_ID=f"{POOL}/successor")
    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    steps = await journal(engine, task_id)
    # The reads ran again and the write was re-sent with its key, each finished at its own sequence.
    assert shape(steps) == [
        (1, "model", COMPLETED),
        (2, "get_customer", COMPLETED),
        (3, "get_customer", COMPLETED),
        (4, "create_ticket", COMPLETED),
        (5, "model", COMPLETED),
    ]
    assert steps[3].idempotency_key == ticket["idempotencyKey"]
    assert tickets_of(crm, customer) == [ticket]
    assert from_struct(done.variables)["triage"]["ticketId"] == ticket["ticketId"]
    calls = fetch_calls(gemini_url)
    assert calls["repeated"] == []
    assert sorted(c["turn"] for c in calls["calls"] if c["status"] == 200) == [0, 1]


TWO_WRITES_IN_ONE_TURN = {
    "scripts": [
        {
            "name": "two-tickets",
            "turns": [
                {
                    "calls": [
                        {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": "{{input.customerId}}",
                                "subject": "Same words",
                                "priority": "low",
                            },
                        },
                        {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": "{{input.customerId}}",
                                "subject": "Same words",
                                "priority": "low",
                            },
                        },
                    ]
                },
                {
                    "json": {
                        "ticketId": "{{tool.crm__create_ticket.ticketId}}",
                        "priority": "low",
                        "_confidence": 95,
                    }
                },
            ],
        }
    ]
}


async def test_two_keyed_writes_in_one_turn_open_two_tickets(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    """Two identical writes the model asked for in one turn are two writes: their keys differ by sequence."""
    load_script(gemini_url, TWO_WRITES_IN_ONE_TURN)
    await deploy_bundle(engine, bundle(crm.url))
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Two, please")
    await workers.start()

    await settled(engine, instance_id)
    steps = await journal(engine, await triage_task_id(engine, instance_id))
    writes = [s for s in steps if s.tool_ref == "crm/create_ticket"]
    assert [(s.sequence, s.state) for s in writes] == [(2, COMPLETED), (3, COMPLETED)]
    assert writes[0].idempotency_key != writes[1].idempotency_key
    tickets = {t["idempotencyKey"]: t for t in tickets_of(crm) if t["subject"] == "Same words"}
    assert set(tickets) >= {writes[0].idempotency_key, writes[1].idempotency_key}
    assert tickets[writes[0].idempotency_key]["ticketId"] != tickets[writes[1].idempotency_key]["ticketId"]
