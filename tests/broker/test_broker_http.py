"""The support triage over HTTP/JSON alone: a worker written with a plain HTTP client (no stubs, no SDK)
against the engine's and the broker's HTTP ports, and the reference scenario's two requests verbatim.

The engine is the suite's (tests/conftest.py, its HTTP side over the same servicers); the broker is a
real process with ABADA_BROKER_HTTP_ADDRESS set, reading the CRM's token from a Vault.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import httpx2
import pytest
import yaml
from broker_support import CRM_CREDENTIAL, POOL
from engine_helpers import support_triage

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = f"{POOL}/http-worker"
SCENARIO_STEP = """{
  "workerId": "agent-worker-1", "attempt": 1, "sequence": 4,
  "kind": "TOOL_CALL", "state": "STARTED", "toolRef": "crm/create_ticket",
  "request": { "callId": "call_2", "arguments": { "customerId": "C-42", "subject": "Parcel not received", "priority": "high" } }
}"""


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))


@pytest.fixture
async def http(engine, engine_http, engine_tokens, broker, dev_tokens):
    """Clients for the engine (as operator, as the worker pool) and the broker (as the worker pool)."""
    assert broker.http_url is not None
    async with (
        httpx2.AsyncClient(
            base_url=engine_http, headers={"Authorization": f"Bearer {engine_tokens.operator}"}, timeout=10
        ) as operator,
        httpx2.AsyncClient(
            base_url=engine_http, headers={"Authorization": f"Bearer {engine_tokens.worker_pool}"}, timeout=10
        ) as worker,
        httpx2.AsyncClient(
            base_url=broker.http_url,
            headers={"Authorization": f"Bearer {dev_tokens.worker_token}"},
            timeout=10,
        ) as credentials,
    ):
        yield operator, worker, credentials


def _ok(response: httpx2.Response) -> dict[str, Any]:
    assert response.status_code == 200, (response.status_code, response.text)
    body: dict[str, Any] = response.json()
    return body


async def _started_task(operator, worker, crm) -> tuple[str, dict[str, Any]]:
    _ok(
        await operator.post(
            "/v1/definitions",
            json={"sourceName": "triage.yaml", "content": support_triage(crm.url, review_on=())},
        )
    )
    started = _ok(
        await operator.post(
            "/v1/processes/support_triage/instances",
            json={"variables": {"customerId": "C-42", "message": "My parcel never arrived"}},
        )
    )
    fetched = _ok(
        await worker.post(
            "/v1/external-tasks:fetchAndLock",
            json={"workerId": WORKER, "topics": [{"name": "abada:agent", "leaseMs": 30000}], "maxTasks": 1},
        )
    )
    [task] = fetched["tasks"]
    return started["instance"]["id"], task


async def test_the_support_triage_driven_over_http_alone_reaches_notify_customer(http, crm):
    operator, worker, credentials = http
    instance_id, task = await _started_task(operator, worker, crm)
    assert task["topicName"] == "abada:agent"
    assert task["variables"] == {"customerId": "C-42", "message": "My parcel never arrived"}
    assert [b["tool"] for b in task["agentWork"]["toolBindings"]] == ["get_customer", "create_ticket"]
    lease = {"Abada-Lease-Token": task["leaseToken"]}
    steps = f"/v1/external-tasks/{task['id']}/steps"

    credential = _ok(
        await credentials.get(
            f"/v1/external-tasks/{task['id']}/tool-credentials/crm",
            params={"workerId": WORKER},
            headers=lease,
        )
    )
    assert credential["secret"] == crm.token and credential["credential"] == CRM_CREDENTIAL

    async def journal(sequence: int, kind: str, state: str, **fields: Any) -> dict[str, Any]:
        body = {
            "workerId": WORKER,
            "attempt": task["attempt"],
            "sequence": sequence,
            "kind": kind,
            "state": state,
        }
        return _ok(await worker.post(steps, json=body | fields, headers=lease))

    await journal(1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await journal(
        1,
        "MODEL_CALL",
        "COMPLETED",
        response={"functionCalls": [{"id": "call_1", "name": "crm__get_customer"}]},
        tokens={"inputTokens": 100, "outputTokens": 10},
    )
    read = await journal(
        2,
        "TOOL_CALL",
        "COMPLETED",
        toolRef="crm/get_customer",
        request={"callId": "call_1", "arguments": {"customerId": "C-42"}},
        response={"structuredContent": {"name": "Alice", "tier": "gold"}},
    )
    assert "idempotencyKey" not in read  # a read carries no key
    await journal(3, "MODEL_CALL", "STARTED", request={"turn": 1})
    await journal(
        3,
        "MODEL_CALL",
        "COMPLETED",
        response={"functionCalls": [{"id": "call_2", "name": "crm__create_ticket"}]},
        tokens={"inputTokens": 150, "outputTokens": 20},
    )
    arguments = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}
    started = await journal(
        4,
        "TOOL_CALL",
        "STARTED",
        toolRef="crm/create_ticket",
        request={"callId": "call_2", "arguments": arguments},
    )
    key = started["idempotencyKey"]
    assert key.startswith("abada-")
    done = await journal(
        4,
        "TOOL_CALL",
        "COMPLETED",
        toolRef="crm/create_ticket",
        response={"structuredContent": {"ticketId": "T-981"}},
    )
    assert done["idempotencyKey"] == key  # the same call, the same key
    await journal(5, "MODEL_CALL", "STARTED", request={"turn": 2})
    await journal(5, "MODEL_CALL", "COMPLETED", tokens={"inputTokens": 200, "outputTokens": 40})

    completed = _ok(
        await worker.post(
            f"/v1/external-tasks/{task['id']}:complete",
            json={
                "workerId": WORKER,
                "leaseToken": task["leaseToken"],
                "variables": {
                    "triage": {"ticketId": "T-981", "priority": "high", "summary": "Order 5531 lost"}
                },
                "metadata": {
                    "model": "gemini-3.6-flash",
                    "provider": "gemini",
                    "inputTokens": "450",
                    "outputTokens": "70",
                    "toolsUsed": ["crm/get_customer", "crm/create_ticket"],
                    "confidence": 92,
                    "modelCalls": 3,
                    "toolCalls": 2,
                },
            },
        )
    )
    assert completed == {"outcome": "COMPLETE_OUTCOME_ADVANCED", "nextNodeId": "notify_customer"}
    instance = _ok(await operator.get(f"/v1/instances/{instance_id}"))["instance"]
    assert instance["currentNodeId"] == "notify_customer"
    assert instance["variables"]["triage"]["ticketId"] == "T-981"
    journaled = _ok(await operator.get(steps))["steps"]
    assert [(s["sequence"], s["kind"], s["state"]) for s in journaled] == [
        (1, "STEP_KIND_MODEL_CALL", "STEP_STATE_COMPLETED"),
        (2, "STEP_KIND_TOOL_CALL", "STEP_STATE_COMPLETED"),
        (3, "STEP_KIND_MODEL_CALL", "STEP_STATE_COMPLETED"),
        (4, "STEP_KIND_TOOL_CALL", "STEP_STATE_COMPLETED"),
        (5, "STEP_KIND_MODEL_CALL", "STEP_STATE_COMPLETED"),
    ]


async def test_the_scenario_requests_verbatim_with_a_lease_token_are_answered_as_it_says(http, crm):
    operator, worker, credentials = http
    _, task = await _started_task(operator, worker, crm)
    lease = {"Abada-Lease-Token": task["leaseToken"]}
    # The scenario's task is task-7f3 and its worker agent-worker-1; here they are the engine's.
    credential = await credentials.get(
        f"/v1/external-tasks/{task['id']}/tool-credentials/crm?workerId={WORKER}", headers=lease
    )
    assert _ok(credential)["secret"] == crm.token
    steps = f"/v1/external-tasks/{task['id']}/steps"
    # Steps 1 to 3 as the scenario's worker journals them: a model call, the read, a model call.
    read = {
        "toolRef": "crm/get_customer",
        "request": {"callId": "call_1", "arguments": {"customerId": "C-42"}},
    }
    for sequence, kind, state, extra in (
        (1, "MODEL_CALL", "STARTED", {}),
        (1, "MODEL_CALL", "COMPLETED", {}),
        (2, "TOOL_CALL", "COMPLETED", read),
        (3, "MODEL_CALL", "STARTED", {}),
        (3, "MODEL_CALL", "COMPLETED", {}),
    ):
        body = {"workerId": WORKER, "attempt": 1, "sequence": sequence, "kind": kind, "state": state}
        _ok(await worker.post(steps, json=body | extra, headers=lease))
    # The scenario's body as it is written; only its worker id is this worker's.
    verbatim = SCENARIO_STEP.replace("agent-worker-1", WORKER)
    answer = await worker.post(steps, content=verbatim, headers=lease | {"Content-Type": "application/json"})
    body = _ok(answer)
    assert body["idempotencyKey"].startswith("abada-")
    assert body["step"]["state"] == "STEP_STATE_STARTED" and body["step"]["toolRef"] == "crm/create_ticket"
    # Without the lease token the same body is refused, as over gRPC, with the ErrorInfo as JSON.
    refused = await worker.post(steps, content=verbatim, headers={"Content-Type": "application/json"})
    assert refused.status_code == 403, refused.text
    assert refused.json()["code"] == 7  # PERMISSION_DENIED
    assert refused.json()["details"] == [
        {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "NOT_LEASE_HOLDER",
            "domain": "abada.dev",
            "metadata": {"field": "lease_token"},
        }
    ]
    # And the credential without a bearer token: 401 with the challenge.
    anonymous = await credentials.get(
        f"/v1/external-tasks/{task['id']}/tool-credentials/crm?workerId={WORKER}",
        headers=lease | {"Authorization": ""},
    )
    assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"] == "Bearer"


async def test_the_broker_serves_its_own_openapi_document(broker):
    assert broker.http_url is not None
    async with httpx2.AsyncClient(base_url=broker.http_url, timeout=10) as client:
        served = (await client.get("/v1/openapi.json")).json()
        nowhere = await client.get("/v1/instances")
    checked_in = json.loads((ROOT / "api" / "openapi" / "broker.openapi.json").read_text())
    assert served == checked_in
    assert set(served["paths"]) == {
        "/v1/external-tasks/{task_id}/tool-credentials/{server}",
        "/v1/deploy-credentials/{credential}:issue",
    }
    # The engine's paths are not the broker's: a JSON refusal, as for any unknown path.
    assert nowhere.status_code == 404 and nowhere.json()["code"] == 5
