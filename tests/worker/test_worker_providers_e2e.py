"""Alice's triage on every provider: a real engine, broker, CRM and worker process, and the
scripted endpoint of that provider driven by its real SDK.

Per provider: the scenario end to end, a worker killed after the write is taken over without a
second ticket or model turn, two parallel calls in one turn, and a 429 with retry-after waited
out inside the attempt while the lease is kept alive. And a node whose provider the worker has no
credentials for fails at once, without retries.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from abada_common.struct_codec import from_struct
from crm_mcp.testing import RunningCrmServer
from engine_helpers import support_triage
from google.protobuf import json_format
from scripted_gemini import SUPPORT_TRIAGE_SCRIPT
from scripted_gemini.testing import fetch_calls, load_script, reset_calls, running_scripted_endpoint
from worker_process import WorkerLauncher
from worker_support import deploy_bundle, history_of, instance_of, start_instance

POOL = "agent-pool"
MODEL, TOOL = external_task_pb2.STEP_KIND_MODEL_CALL, external_task_pb2.STEP_KIND_TOOL_CALL
STARTED, COMPLETED = external_task_pb2.STEP_STATE_STARTED, external_task_pb2.STEP_STATE_COMPLETED
STEP_NAMES = {
    (MODEL, ""): "model",
    (TOOL, "crm/get_customer"): "get_customer",
    (TOOL, "crm/create_ticket"): "create_ticket",
}
ALICE_JOURNAL = ["model", "get_customer", "model", "create_ticket", "model"]
# Keys the worker is given: none of them may show up in a log line or the journal.
API_KEYS = {
    "gemini": "AIza-e2e-gemini-key-0123456789",
    "openai": "sk-e2e-openai-key-0123456789",
    "anthropic": "sk-ant-e2e-anthropic-key-0123456789",
}


@dataclass(frozen=True)
class Provider:
    name: str
    model: str
    url: str

    def worker_env(self) -> dict[str, str]:
        key_variable = f"{self.name.upper()}_API_KEY"
        base = {"gemini": self.url, "openai": f"{self.url}/v1", "anthropic": self.url}[self.name]
        return {key_variable: API_KEYS[self.name], f"ABADA_{self.name.upper()}_BASE_URL": base}


MODELS = {"gemini": "gemini-3.6-flash", "openai": "gpt-5-mini", "anthropic": "claude-sonnet-4-5"}


def bundle(crm_url: str, model: str) -> str:
    return support_triage(crm_url, model=model)


ALL = pytest.mark.parametrize("provider", ["gemini", "openai", "anthropic"], indirect=True)
# Gemini's scenario and takeover run in test_worker_e2e.py already.
NEW = pytest.mark.parametrize("provider", ["openai", "anthropic"], indirect=True)


@pytest.fixture(scope="module")
def provider(request: pytest.FixtureRequest) -> Iterator[Provider]:
    with running_scripted_endpoint(f"scripted_{request.param}.server") as url:
        yield Provider(request.param, MODELS[request.param], url)


# The CRM, broker and worker launcher are tests/worker/conftest.py's (an empty CRM for every test);
# the model is each test's provider endpoint, passed when a worker starts.
pytestmark = pytest.mark.usefixtures("crm")


@pytest.fixture
def model_settings() -> dict[str, str]:
    return {}


@pytest.fixture
def worker_settings() -> dict[str, str]:
    return {"ABADA_WORKER_ID": f"{POOL}/providers"}


@pytest.fixture
def endpoint(provider: Provider) -> Provider:
    load_script(provider.url, SUPPORT_TRIAGE_SCRIPT)
    reset_calls(provider.url)
    return provider


async def settled(engine, instance_id: str, timeout: float = 60.0) -> process_pb2.Instance:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        found = await instance_of(engine, instance_id)
        if found.current_node_id != "triage" or found.open_incidents:
            return found
        assert time.monotonic() < deadline, f"instance {instance_id} still at triage after {timeout}s"
        await asyncio.sleep(0.1)


async def task_of(engine, instance_id: str) -> str:  # type: ignore[no-untyped-def]
    return next(
        e.task_id for e in await history_of(engine, instance_id) if e.node_id == "triage" and e.task_id
    )


async def journal(engine, task_id: str) -> list[external_task_pb2.JournalStep]:  # type: ignore[no-untyped-def]
    return list((await engine.tasks.GetJournal(external_task_pb2.GetJournalRequest(task_id=task_id))).steps)


def names(steps: list[external_task_pb2.JournalStep]) -> list[str]:
    return [STEP_NAMES[(s.kind, s.tool_ref)] for s in steps]


def completed(events: list[Any]) -> dict[str, Any]:
    (done,) = [e for e in events if e.type == "TASK_COMPLETED" and e.node_id == "triage"]
    return json_format.MessageToDict(done.data)


@NEW
async def test_alice_is_triaged_end_to_end(
    engine, crm: RunningCrmServer, endpoint: Provider, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url, endpoint.model))
    instance_id = await start_instance(
        engine, "support_triage", customerId="C-42", message="My parcel never arrived"
    )
    # At DEBUG the SDKs would log their request options; no key may come out even so.
    worker = await workers.start(ABADA_LOG_LEVEL="DEBUG", **endpoint.worker_env())

    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    triage = from_struct(done.variables)["triage"]
    assert triage["priority"] == "high" and triage["ticketId"].startswith("T-")
    steps = await journal(engine, await task_of(engine, instance_id))
    assert names(steps) == ALICE_JOURNAL
    assert all(s.state == COMPLETED and s.attempt == 1 for s in steps)
    first_turn, lookup = from_struct(steps[0].response), from_struct(steps[1].request)
    assert from_struct(steps[0].request) == {"turn": 0, "model": endpoint.model, "provider": endpoint.name}
    assert first_turn["finish"] == "tool_calls"
    # The tool step names the provider's own call id, which replay matches the turn's call by.
    assert lookup["callId"] == first_turn["functionCalls"][0]["id"]
    assert from_struct(steps[4].response)["finish"] == "stop"
    metadata = completed(await history_of(engine, instance_id))["metadata"]
    assert (metadata["provider"], metadata["model"]) == (endpoint.name, endpoint.model)
    assert (metadata["model_calls"], metadata["tool_calls"], metadata["quota_wait_ms"]) == (3, 2, 0)
    assert fetch_calls(endpoint.url)["repeated"] == []

    assert await worker.terminate() == 0
    assert API_KEYS[endpoint.name] not in worker.log_text
    assert all(API_KEYS[endpoint.name] not in json_format.MessageToJson(s) for s in steps)


@NEW
async def test_a_worker_killed_after_the_write_is_taken_over_without_a_second_ticket_or_turn(
    engine, crm: RunningCrmServer, endpoint: Provider, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url, endpoint.model))
    customer = "C-7"
    tickets_before = len(crm.tickets())
    instance_id = await start_instance(
        engine, "support_triage", customerId=customer, message="Parcel missing"
    )
    doomed = await workers.start(
        ABADA_WORKER_ID=f"{POOL}/doomed",
        ABADA_WORKER_FAULT="kill-after-send:crm/create_ticket",
        **endpoint.worker_env(),
    )

    assert await doomed.wait(timeout=30) == -signal.SIGKILL
    task_id = await task_of(engine, instance_id)
    steps = await journal(engine, task_id)
    assert names(steps) == ALICE_JOURNAL[:4]
    assert steps[3].state == STARTED  # the write happened; its result was never journaled
    (ticket,) = crm.tickets()[tickets_before:]  # the write did happen before the crash

    await workers.start(ABADA_WORKER_ID=f"{POOL}/successor", **endpoint.worker_env())
    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    assert from_struct(done.variables)["triage"]["ticketId"] == ticket["ticketId"]
    steps = await journal(engine, task_id)
    assert names(steps) == ALICE_JOURNAL
    assert [s.attempt for s in steps] == [1, 1, 1, 1, 2]
    assert steps[3].state == COMPLETED and steps[3].idempotency_key == ticket["idempotencyKey"]
    assert crm.tickets()[tickets_before:] == [ticket]
    calls = fetch_calls(endpoint.url)
    assert calls["repeated"] == []
    assert sorted(c["turn"] for c in calls["calls"]) == [0, 1, 2]


PARALLEL_LOOKUPS = {
    "scripts": [
        {
            "name": "parallel",
            "turns": [
                {
                    "calls": [
                        {"name": "crm__get_customer", "args": {"customerId": "{{input.customerId}}"}},
                        {"name": "crm__get_customer", "args": {"customerId": "C-7"}},
                    ]
                },
                {
                    "call": {
                        "name": "crm__create_ticket",
                        "args": {
                            "customerId": "{{input.customerId}}",
                            "subject": "Parcel not received",
                            "priority": "high",
                        },
                    }
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


@ALL
async def test_two_parallel_calls_in_one_turn_are_run_journaled_and_answered_together(
    engine, crm: RunningCrmServer, endpoint: Provider, workers: WorkerLauncher
) -> None:
    load_script(endpoint.url, PARALLEL_LOOKUPS)
    await deploy_bundle(engine, bundle(crm.url, endpoint.model))
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Two accounts")
    await workers.start(**endpoint.worker_env())

    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    steps = await journal(engine, await task_of(engine, instance_id))
    assert names(steps) == ["model", "get_customer", "get_customer", "model", "create_ticket", "model"]
    turn_calls = [call["id"] for call in from_struct(steps[0].response)["functionCalls"]]
    assert len(set(turn_calls)) == 2
    assert [from_struct(s.request)["callId"] for s in steps[1:3]] == turn_calls
    # The endpoint took the second turn only because both results came back with their ids.
    assert [c["status"] for c in fetch_calls(endpoint.url)["calls"]] == [200, 200, 200]


RATE_LIMITED_SECOND_TURN = {
    "scripts": [
        {
            "name": "rate_limited",
            "turns": [
                {"call": {"name": "crm__get_customer", "args": {"customerId": "{{input.customerId}}"}}},
                {
                    "call": {
                        "name": "crm__create_ticket",
                        "args": {
                            "customerId": "{{input.customerId}}",
                            "subject": "Parcel not received",
                            "priority": "high",
                        },
                    },
                    # Longer than the whole 2 s lease: only a renewed lease lets the attempt finish.
                    "rate_limit": {"retry_after_seconds": 2.5},
                },
                {
                    "json": {
                        "ticketId": "{{tool.crm__create_ticket.ticketId}}",
                        "priority": "high",
                        "_confidence": 92,
                    }
                },
            ],
        }
    ]
}


@ALL
async def test_a_429_with_retry_after_is_waited_out_without_failing_the_attempt(
    engine, crm: RunningCrmServer, endpoint: Provider, workers: WorkerLauncher
) -> None:
    load_script(endpoint.url, RATE_LIMITED_SECOND_TURN)
    await deploy_bundle(engine, bundle(crm.url, endpoint.model))
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Busy day")
    worker = await workers.start(**endpoint.worker_env())

    done = await settled(engine, instance_id)

    assert done.current_node_id == "notify_customer"
    events = await history_of(engine, instance_id)
    assert "TASK_FAILED" not in [e.type for e in events]
    finished = completed(events)
    assert finished["attempt"] == 1
    assert finished["metadata"]["quota_wait_ms"] >= 2400
    steps = await journal(engine, await task_of(engine, instance_id))
    assert names(steps) == ALICE_JOURNAL and all(s.attempt == 1 and s.state == COMPLETED for s in steps)
    calls = fetch_calls(endpoint.url)["calls"]
    assert [(c["turn"], c["status"]) for c in calls] == [(0, 200), (1, 429), (1, 200), (2, 200)]
    (waiting,) = [r for r in worker.records if r.get("message") == "waiting for model quota"]
    assert (waiting["source"], waiting["wait_seconds"]) == (endpoint.name, 2.5)


async def test_a_node_on_a_provider_the_worker_has_no_credentials_for_fails_without_retries(
    engine, crm: RunningCrmServer, workers: WorkerLauncher
) -> None:
    await deploy_bundle(engine, bundle(crm.url, MODELS["anthropic"]))
    instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Hello")
    # OpenAI and Gemini are configured (endpoints that are never reached); Anthropic is not.
    await workers.start(
        OPENAI_API_KEY=API_KEYS["openai"],
        ABADA_GEMINI_BASE_URL="http://127.0.0.1:9",
        ABADA_OPENAI_BASE_URL="http://127.0.0.1:9/v1",
    )

    done = await settled(engine, instance_id)

    assert done.open_incidents == 1
    (incident,) = (
        await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=instance_id))
    ).incidents
    assert incident.type == "MODEL_PROVIDER_UNAVAILABLE"
    assert "no credentials for provider 'anthropic'" in incident.message
    assert "ANTHROPIC_API_KEY" in incident.message
    assert [e.type for e in await history_of(engine, instance_id)].count("TASK_FAILED") == 1
    assert await journal(engine, await task_of(engine, instance_id)) == []


async def test_a_refusal_ends_the_task_as_invalid_output_for_a_person_to_review(
    engine, crm: RunningCrmServer, workers: WorkerLauncher
) -> None:
    refusal = [{"refusal": "I can't help with that."}]
    with running_scripted_endpoint("scripted_anthropic.server", refusal) as url:
        await deploy_bundle(engine, bundle(crm.url, MODELS["anthropic"]))
        instance_id = await start_instance(engine, "support_triage", customerId="C-42", message="Hello")
        await workers.start(**Provider("anthropic", MODELS["anthropic"], url).worker_env())

        done = await settled(engine, instance_id)

    assert done.current_node_id == "review"
    (rejected,) = [e for e in await history_of(engine, instance_id) if e.type == "OUTPUT_REJECTED"]
    assert from_struct(rejected.data)["verdict"] == "invalid_output"
    assert "the model refused: I can't help with that." in from_struct(rejected.data)["reason"]
    (turn,) = await journal(engine, await task_of(engine, instance_id))
    assert from_struct(turn.response)["finish"] == "refusal"
