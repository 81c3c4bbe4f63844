"""The world's outages waited out: the model provider, the CRM, the broker and Vault each down for 30 s
while 50 instances of the support triage are in flight.

Every instance reaches notify_customer with exactly one ticket, no model turn is paid twice and no
incident is raised: a temporary failure costs time, not attempts. During the provider's outage the
provider sees probes (one task at a time, backing off), not 50 workers' retries. A provider refusing
the worker's key is the opposite case: one request, one incident at once, naming the credential.
An outage longer than a node's outage_budget gives one DEPENDENCY_UNAVAILABLE incident per waiting
task, and one bulk retry after the dependency is back finishes them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import secrets
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator

import grpc
import pytest
from abada.engine.v1 import (
    dependency_pb2,
    dependency_pb2_grpc,
    incident_pb2,
    incident_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from crm_mcp.testing import RunningCrmServer, running_crm_server
from fault_stack import (
    Stack,
    alice_script,
    free_port,
    judge,
    running_stack,
    start_instances,
    wait_for,
    wait_until_finished,
)
from scripted_gemini.testing import fetch_calls, running_scripted_gemini, set_outage

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "vault"))
from openbao import OpenBao

INSTANCES = 50
WORKERS = 2
CONCURRENCY = 25
# A credential is asked for when a task starts: the broker's and Vault's outages must meet tasks starting.
STAGGERED = 5
OUTAGE_SECONDS = 30.0
# Each model turn takes this long to answer, so the 50 instances are still in flight when the outage comes.
TURN_DELAY_MS = 1_500
# The outage begins once this many tickets exist: some instances past the write, most still working.
TICKETS_BEFORE_OUTAGE = 5
MODEL = dependency_pb2.Dependency(kind=dependency_pb2.DEPENDENCY_KIND_MODEL, name="gemini-3.6-flash")


@pytest.fixture
def gemini_url():  # type: ignore[no-untyped-def]
    """A scripted endpoint of the test's own: its outage and its ledger are this test's alone."""
    with running_scripted_gemini(alice_script()) as url:
        yield url


@contextlib.asynccontextmanager
async def triage_in_flight(
    stack: Stack, crm: RunningCrmServer, drill: str, concurrency: int = CONCURRENCY
) -> AsyncIterator[list[str]]:
    """50 instances started and being worked on by 2 workers; yields once a few tickets exist.

    With 25 tasks a worker, every instance is at work at once; with fewer, tasks keep starting
    (asking the broker for the CRM's credential) while the outage lasts."""
    async with stack.engine.channel() as channel:
        ids = await start_instances(channel, drill, INSTANCES)
    for index in range(WORKERS):
        stack.add_worker(f"w{index}", concurrency=concurrency)
    await wait_for(
        lambda: sum(drill in ticket["subject"] for ticket in crm.tickets()) >= TICKETS_BEFORE_OUTAGE,
        "the first tickets",
        120,
        0.05,
    )
    yield ids


async def finished_cleanly(
    stack: Stack, crm: RunningCrmServer, gemini_url: str, drill: str, ids: list[str], waited_for: str
) -> None:
    """Every instance finished with one ticket, nothing re-paid, no incident; and the outage was met:
    tasks were parked for `waited_for` (a dependency key) on the way."""
    channel = stack.engine.channel()
    try:
        stuck = await wait_until_finished(lambda: channel, ids, timeout=180)
        parked = await parked_for(channel, ids)
        incidents = (
            await incident_pb2_grpc.IncidentServiceStub(channel).ListIncidents(
                incident_pb2.ListIncidentsRequest(), timeout=10
            )
        ).incidents
        dependencies = (
            await dependency_pb2_grpc.DependencyServiceStub(channel).ListDependencies(
                dependency_pb2.ListDependenciesRequest(), timeout=10
            )
        ).dependencies
    finally:
        await channel.close()
    outcome = judge(crm, gemini_url, drill, ids, stuck)
    print(f"\nfault {drill}: {outcome.summary()}; incidents={len(incidents)}")
    assert not stuck, stack.logs()
    outcome.assert_clean()
    assert [f"{i.type}: {i.message}" for i in incidents] == [], (
        "a temporary outage became a person's incident"
    )
    assert {d.state for d in dependencies} <= {dependency_pb2.DEPENDENCY_STATE_UP}, dependencies
    print(f"tasks parked on the way, by dependency: {dict(parked)}")
    assert parked[waited_for] >= 3, f"the outage of {waited_for} held no task: {dict(parked)}"


async def parked_for(channel: grpc.aio.Channel, ids: list[str]) -> Counter[str]:
    """How often the instances' tasks were parked, by the dependency they waited for (their history)."""
    stub = process_pb2_grpc.ProcessServiceStub(channel)
    counts: Counter[str] = Counter()
    for instance_id in ids:
        history = await stub.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id), timeout=10)
        for event in history.events:
            if event.type == "TASK_PARKED":
                counts[event.data["dependency"]] += 1
    return counts


def provider_requests_between(gemini_url: str, began: float, ended: float) -> int:
    return sum(1 for call in fetch_calls(gemini_url)["calls"] if began <= call["time"] <= ended)


async def test_a_provider_outage_is_waited_out_and_the_provider_sees_probes_not_a_stampede(
    tmp_path, shared_database, crm, gemini_url
):
    drill = "provider-503"
    async with running_stack(
        tmp_path, shared_database, crm, gemini_url, script=alice_script(TURN_DELAY_MS)
    ) as stack:
        async with triage_in_flight(stack, crm, drill) as ids:
            set_outage(gemini_url, 503)
            began = time.time()
            await asyncio.sleep(OUTAGE_SECONDS)  # the outage itself
            set_outage(gemini_url, 0)
            ended = time.time()
            await finished_cleanly(stack, crm, gemini_url, drill, ids, "model:gemini-3.6-flash")
            # Each worker says once that the model went down and once that it is back: not a line a retry.
            for worker in stack.workers:
                lines = worker.log.read_text().splitlines()
                down = [line for line in lines if '"dependency down"' in line]
                back = [line for line in lines if '"dependency back"' in line]
                assert len(down) <= 1 and len(back) == len(down), (worker.name, down, back)
    refused = [call for call in fetch_calls(gemini_url)["calls"] if call["status"] == 503]
    during = provider_requests_between(gemini_url, began, ended)
    print(f"provider requests during the {OUTAGE_SECONDS:.0f} s outage: {during} ({len(refused)} refused)")
    assert refused, "the outage met no request: it came too late to prove anything"
    assert during <= OUTAGE_SECONDS, f"{during} requests in {OUTAGE_SECONDS:.0f} s: more than 1 a second"


async def test_a_tool_server_restart_is_waited_out(tmp_path, shared_database, gemini_url):
    drill = "crm-restart"
    port, token, database = free_port(), secrets.token_urlsafe(24), tmp_path / "crm.sqlite3"
    first = contextlib.ExitStack()
    crm = first.enter_context(running_crm_server(db_path=database, port=port, token=token))
    try:
        async with running_stack(
            tmp_path, shared_database, crm, gemini_url, script=alice_script(TURN_DELAY_MS)
        ) as stack:
            async with triage_in_flight(stack, crm, drill) as ids:
                first.close()  # the CRM is gone: connections refused
                await asyncio.sleep(OUTAGE_SECONDS)
                with running_crm_server(db_path=database, port=port, token=token) as restarted:
                    await finished_cleanly(stack, restarted, gemini_url, drill, ids, "tool_server:crm")
    finally:
        first.close()


async def test_a_broker_restart_is_waited_out(tmp_path, shared_database, crm, gemini_url):
    drill = "broker-restart"
    async with running_stack(
        tmp_path, shared_database, crm, gemini_url, script=alice_script(TURN_DELAY_MS)
    ) as stack:
        async with triage_in_flight(stack, crm, drill, STAGGERED) as ids:
            stack.broker.kill()
            await asyncio.sleep(OUTAGE_SECONDS)
            stack.broker.start()
            await finished_cleanly(stack, crm, gemini_url, drill, ids, "broker:broker")


async def test_vault_sealed_mid_flight_is_waited_out_by_a_broker_reading_only_the_credentials(
    tmp_path, shared_database, crm, gemini_url
):
    drill = "vault-sealed"
    openbao = OpenBao(tmp_path)
    openbao.start()
    try:
        openbao.put_secret("abada/tool-credentials/crm-token", {"value": crm.token})
        openbao.add_reader_policy(
            "abada-broker",
            {
                "secret/data/abada/tool-credentials/*": ["read"],
                "secret/metadata/abada/tool-credentials/*": ["read"],
            },
        )
        broker_env = {
            "ABADA_SECRET_BACKEND": "vault",
            "VAULT_ADDR": openbao.url,
            "VAULT_TOKEN": openbao.create_token(["abada-broker"]),
            "ABADA_VAULT_TIMEOUT_SECONDS": "1",
            # Every credential is read from Vault: a cached one would hide the seal.
            "ABADA_SECRET_CACHE_SECONDS": "0",
        }
        async with running_stack(
            tmp_path,
            shared_database,
            crm,
            gemini_url,
            script=alice_script(TURN_DELAY_MS),
            broker_env=broker_env,
        ) as stack:
            async with triage_in_flight(stack, crm, drill, STAGGERED) as ids:
                openbao.seal()
                await asyncio.sleep(OUTAGE_SECONDS)
                openbao.unseal()
                await finished_cleanly(stack, crm, gemini_url, drill, ids, "secret_store:secret-store")
    finally:
        openbao.stop()


async def test_a_rejected_provider_key_is_one_request_and_one_incident_at_once(
    tmp_path, shared_database, crm, gemini_url
):
    async with running_stack(tmp_path, shared_database, crm, gemini_url) as stack:
        set_outage(gemini_url, 401)
        async with stack.engine.channel() as channel:
            (instance_id,) = await start_instances(channel, "provider-401", 1)
            stack.add_worker("w0")
            incidents = incident_pb2_grpc.IncidentServiceStub(channel)

            async def raised() -> list[incident_pb2.Incident]:
                request = incident_pb2.ListIncidentsRequest(instance_id=instance_id)
                return list((await incidents.ListIncidents(request, timeout=5)).incidents)

            (incident,) = await wait_for(raised, "the incident", 60)
            await asyncio.sleep(2)  # anything more the worker would do, it would have done by now
            assert len(await raised()) == 1
    assert incident.type == "MODEL_CREDENTIAL_REJECTED"
    assert "GEMINI_API_KEY" in incident.message and "401" in incident.message, incident.message
    assert [call["status"] for call in fetch_calls(gemini_url)["calls"]] == [401]


async def test_an_outage_past_the_budget_is_one_incident_per_task_and_one_bulk_retry_finishes_them(
    tmp_path, shared_database, crm, gemini_url
):
    drill = "past-budget"
    count = 10
    async with running_stack(
        tmp_path, shared_database, crm, gemini_url, outage_budget="PT5S", script=alice_script(TURN_DELAY_MS)
    ) as stack:
        async with stack.engine.channel() as channel:
            ids = await start_instances(channel, drill, count)
            set_outage(gemini_url, 503)
            stack.add_worker("w0", concurrency=count)
            incidents = incident_pb2_grpc.IncidentServiceStub(channel)
            listing = incident_pb2.ListIncidentsRequest(type="DEPENDENCY_UNAVAILABLE", dependency=MODEL)

            async def every_task_held() -> list[incident_pb2.Incident]:
                found = list((await incidents.ListIncidents(listing, timeout=5)).incidents)
                return found if len(found) >= count else []

            held = await wait_for(every_task_held, "an incident for every task", 60)
            await asyncio.sleep(3)  # budget rounds run every 2 s: a second incident would show by now
            held = list((await incidents.ListIncidents(listing, timeout=5)).incidents)
            assert len(held) == count and len({i.task_id for i in held}) == count, held
            assert {i.instance_id for i in held} == set(ids)
            assert all("gemini-3.6-flash" in i.message and "unavailable" in i.message for i in held)

            set_outage(gemini_url, 0)
            retried = await incidents.ResolveIncidents(
                incident_pb2.ResolveIncidentsRequest(
                    type="DEPENDENCY_UNAVAILABLE",
                    dependency=MODEL,
                    resolution=incident_pb2.RESOLUTION_RETRY,
                    comment="the provider is back",
                ),
                timeout=30,
            )
            assert len(retried.resolved) == count and not retried.refused and retried.remaining == 0
        await finished_cleanly(stack, crm, gemini_url, drill, ids, "model:gemini-3.6-flash")


async def test_the_operator_sees_the_dependency_down_and_the_tasks_held_for_it(
    tmp_path, shared_database, crm, gemini_url
):
    async with running_stack(tmp_path, shared_database, crm, gemini_url) as stack:
        set_outage(gemini_url, 503)
        async with stack.engine.channel() as channel:
            ids = await start_instances(channel, "seen", 4)
            stack.add_worker("w0")
            listing = dependency_pb2_grpc.DependencyServiceStub(channel)

            async def down() -> dependency_pb2.DependencyStatus | None:
                reply = await listing.ListDependencies(dependency_pb2.ListDependenciesRequest(), timeout=5)
                for status in reply.dependencies:
                    if status.dependency == MODEL and status.held_tasks >= 3:
                        return status
                return None

            status = await wait_for(down, "the model down with tasks held", 60)
            assert status.state in (
                dependency_pb2.DEPENDENCY_STATE_DOWN,
                dependency_pb2.DEPENDENCY_STATE_PROBING,
            )
            assert "503" in status.last_error and status.HasField("down_since")
            instance = (
                await process_pb2_grpc.ProcessServiceStub(channel).GetInstance(
                    process_pb2.GetInstanceRequest(instance_id=ids[0]), timeout=5
                )
            ).instance
            assert instance.current_node_id == "triage"
            set_outage(gemini_url, 0)
        await finished_cleanly(stack, crm, gemini_url, "seen", ids, "model:gemini-3.6-flash")
