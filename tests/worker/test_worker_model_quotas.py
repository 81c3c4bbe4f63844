"""Many instances at once against a model quota, and a spend budget, with real processes.

The engine, the credential broker, the demo CRM, the scripted Gemini endpoint (whose ledger records
when each model call reached it) and two worker processes. The quota is the profile's real
`requests_per_minute`; the test lasts a little over a minute because that is what the quota allows.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from abada.engine.v1 import incident_pb2
from abada_common.struct_codec import from_struct
from abada_engine import metrics
from abada_engine.runtime.queue_stats import QueueStats
from crm_mcp.testing import RunningCrmServer
from scripted_gemini.testing import fetch_calls, load_script
from test_worker_e2e import POOL, completed_metadata, journal, settled, triage_task_id
from worker_process import WorkerLauncher
from worker_support import deploy_bundle, history_of, instance_of, start_instance

RPM = 40
INSTANCES = 20

THREE_CALLS = {
    "scripts": [
        {
            "name": "three_calls",
            "turns": [
                {"call": {"name": "crm__get_customer", "args": {"customerId": "{{input.customerId}}"}}},
                {"call": {"name": "crm__get_customer", "args": {"customerId": "C-7"}}},
                {"json": {"ticketId": "none", "priority": "low", "_confidence": 90}},
            ],
        }
    ]
}


def quota_bundle(crm_url: str, profile: str, limits: str) -> str:
    return f"""
models:
  - name: gemini-3.6-flash
    provider: gemini
    {profile}
tool_servers:
  - name: crm
    transport: streamable-http
    url: {crm_url}
    credential: crm-token
    tools:
      get_customer:  {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: key }}
processes:
  - id: support_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Read the message from ${{customerId}} and answer in JSON.
        inputs: {{ customerId: "${{customerId}}", message: "${{message}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        output_schema: {{ type: object, required: [ticketId, priority] }}
        limits: {limits}
        next: notify_customer
      - {{ id: notify_customer, type: service, topic: notify, next: done }}
      - {{ id: done, type: end }}
"""


# The collaborators are tests/worker/conftest.py's (an empty CRM and a fresh ledger for every test);
# here two workers of ten tasks each hold 5 s leases while they wait for the quota.
pytestmark = pytest.mark.usefixtures("crm", "gemini_url")


@pytest.fixture
def worker_settings() -> dict[str, str]:
    return {"ABADA_WORKER_ID": f"{POOL}/quota", "ABADA_LEASE_MS": "5000", "ABADA_WORKER_CONCURRENCY": "10"}


def busiest_minute(times: list[float]) -> int:
    """The most calls any 60-second window of the ledger holds."""
    ordered = sorted(times)
    return max(sum(1 for t in ordered if start <= t < start + 60) for start in ordered)


def counter(name: str, **labels: str) -> float:
    value = metrics.REGISTRY.get_sample_value(name, labels)
    return value or 0.0


async def test_more_calls_than_the_quota_allows_wait_their_turn_and_all_finish(
    engine, db, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    await deploy_bundle(
        engine,
        quota_bundle(crm.url, f"requests_per_minute: {RPM}", "{ max_model_calls: 5, max_tool_calls: 5 }"),
    )
    load_script(gemini_url, THREE_CALLS)
    admitted_before = counter("abada_model_calls_admitted_total", model="gemini-3.6-flash")
    instance_ids = [
        await start_instance(engine, "support_triage", customerId="C-42", message=f"Question {n}")
        for n in range(INSTANCES)
    ]
    await workers.start(ABADA_WORKER_ID=f"{POOL}/quota-1")
    await workers.start(ABADA_WORKER_ID=f"{POOL}/quota-2")

    stats = QueueStats(db)
    most_waiting = 0
    deadline = time.monotonic() + 150
    while True:
        topic = await stats.topic("abada:agent")
        if topic.quota_waiting > most_waiting:
            most_waiting = topic.quota_waiting
            # Calls waiting for quota are counted apart: more pods would not make them go faster.
            assert topic.demand == topic.ready + topic.leased - topic.quota_waiting
        states = [await settled_or_none(engine, i) for i in instance_ids]
        if all(states):
            break
        assert time.monotonic() < deadline, f"{states.count(None)} instances still at triage"
        await asyncio.sleep(0.5)

    assert {s.current_node_id for s in states if s} == {"notify_customer"}
    played = [c for c in fetch_calls(gemini_url)["calls"] if c["status"] == 200]
    assert len(played) == INSTANCES * 3
    assert busiest_minute([c["time"] for c in played]) <= RPM
    # It did have to wait: the calls spread over more than a minute, and the line was seen.
    assert max(c["time"] for c in played) - min(c["time"] for c in played) > 60
    assert most_waiting > 0
    assert fetch_calls(gemini_url)["repeated"] == []
    waited = []
    for instance_id in instance_ids:
        events = await history_of(engine, instance_id)
        assert "TASK_FAILED" not in [e.type for e in events]  # no attempt failed for quota
        done = completed_metadata(events)
        assert done["attempt"] == 1
        waited.append(int(done["metadata"].get("quota_wait_ms", 0)))
    # 20 calls had to wait for the window to move (about a minute), at most three of them per instance;
    # each attempt reports the time it waited.
    assert sum(1 for ms in waited if ms >= 50_000) >= (INSTANCES * 3 - RPM) // 3, waited
    assert counter("abada_model_calls_admitted_total", model="gemini-3.6-flash") - admitted_before == 60
    assert (
        counter("abada_model_calls_refused_total", model="gemini-3.6-flash", reason="requests_per_minute") > 0
    )


async def settled_or_none(engine: Any, instance_id: str) -> Any:
    found = await instance_of(engine, instance_id)
    return found if found.current_node_id != "triage" or found.open_incidents else None


RUNAWAY = {
    "scripts": [
        {
            "name": "runaway",
            "turns": [
                {"call": {"name": "crm__get_customer", "args": {"customerId": "{{input.customerId}}"}}},
                {"call": {"name": "crm__get_customer", "args": {"customerId": "C-7"}}, "repeat": True},
            ],
        }
    ]
}


async def test_a_budget_stops_a_runaway_agent_naming_max_cost_usd_and_the_cost_is_shown(
    engine, crm: RunningCrmServer, gemini_url: str, workers: WorkerLauncher
) -> None:
    # $10 per million tokens either way; the scripted endpoint counts about a token per four characters.
    profile = "price: { input_per_million_usd: 10, output_per_million_usd: 10 }"
    await deploy_bundle(
        engine,
        quota_bundle(crm.url, profile, "{ max_model_calls: 100, max_tool_calls: 100, max_cost_usd: 0.02 }"),
    )
    load_script(gemini_url, RUNAWAY)
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Loop forever")
    await workers.start()

    done = await settled(engine, instance_id, timeout=60)

    assert done.open_incidents == 1
    (incident,) = (
        await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=instance_id))
    ).incidents
    assert incident.type == "LIMIT_EXCEEDED"
    assert from_struct(incident.details)["details"]["limit"] == "max_cost_usd"
    assert "max_cost_usd $0.02" in incident.message
    steps = await journal(engine, await triage_task_id(engine, instance_id))
    model_costs = [s.cost_usd for s in steps if s.kind == 1]
    spent = sum(model_costs)
    assert spent >= 0.02 and spent - model_costs[-1] < 0.02  # stopped at the first call past the budget
    assert f"${spent:.6f}" in incident.message
    assert all(cost > 0 for cost in model_costs)
    assert len(model_costs) < 100  # the budget, not max_model_calls, stopped it
