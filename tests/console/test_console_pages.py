"""The console's pages without a browser: what sign-in accepts and the cookie it sets, an altered or
foreign cookie, resolving an incident and completing a user task through the console's forms, each
checked against what the engine then holds."""

from __future__ import annotations

import pathlib
import re
import sys
from collections.abc import AsyncIterator

import httpx2
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from abada_engine.api.http import build_app
from abada_engine.auth import CallerRegistry
from abada_engine.console import Engine, build_console
from abada_engine.console.session import COOKIE, Sealer
from abada_engine.runtime.queue_stats import QueueStats
from abada_sdk.connection import Connection
from engine_helpers import deploy, fetch, journal, plain, struct

# The engine tests' way to a TOOL_OUTCOME_UNKNOWN incident: an unkeyed write whose worker vanished.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "engine"))
from test_engine_takeover import WRITE, _unknown_outcome_incident

SECRET = b"console-pages-secret-long-enough-for-it"

FAILING = """
processes:
  - id: billing
    start: charge
    nodes:
      - { id: charge, type: service, topic: billing, retries: 0, next: done }
      - { id: done, type: end }
"""

REVIEWED = """
processes:
  - id: triage_review
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Triage ${customerId}.
        inputs: { customerId: "${customerId}" }
        result_variable: triage
        output_schema:
          type: object
          required: [ticketId, priority]
          properties:
            ticketId: { type: string, minLength: 1 }
            priority: { type: string, enum: [low, normal, high, urgent] }
            refund: { type: number }
        on_invalid_output: review
        next: done
      - { id: review, type: user_task, next: done }
      - { id: done, type: end }
"""


@pytest.fixture
async def client(engine, engine_tokens, db) -> AsyncIterator[httpx2.AsyncClient]:  # type: ignore[no-untyped-def]
    console_engine = Engine(Connection(address=engine.address))
    app = build_app(
        QueueStats(db),
        CallerRegistry(engine_tokens.callers_file),
        console=build_console(console_engine, SECRET),
    )
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        yield http
    await console_engine.close()


def csrf_of(html: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', html)
    assert found, "the page has no CSRF field"
    return found.group(1)


async def sign_in(client: httpx2.AsyncClient, token: str) -> httpx2.Response:
    page = await client.get("/console/login")
    return await client.post("/console/login", data={"csrf": csrf_of(page.text), "token": token})


async def test_sign_in_checks_the_token_with_the_engine_and_seals_it(client, engine_tokens) -> None:  # type: ignore[no-untyped-def]
    unknown = await sign_in(client, "not-a-token")
    assert unknown.status_code == 401 and "does not know this token" in unknown.text
    worker = await sign_in(client, engine_tokens.worker_pool)
    assert worker.status_code == 403 and "neither the operator nor the approver" in worker.text

    signed = await sign_in(client, engine_tokens.operator)
    assert signed.status_code == 303 and signed.headers["location"] == "/console/instances"
    cookie = next(h for h in signed.headers.get_list("set-cookie") if h.startswith(COOKIE + "="))
    flags = cookie.lower()
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console/" in flags
    assert "secure" not in flags  # on loopback; off it the cookie is Secure (next test)
    assert engine_tokens.operator not in cookie
    page = await client.get("/console/instances")
    assert page.status_code == 200

    signed_out = await client.post("/console/logout", data={"csrf": csrf_of(page.text)})
    assert signed_out.headers["location"] == "/console/login"
    assert (await client.get("/console/instances")).headers["location"] == "/console/login"


async def test_a_cookie_off_loopback_is_secure_and_a_form_without_csrf_is_refused(
    engine_tokens, engine, db
) -> None:  # type: ignore[no-untyped-def]
    console_engine = Engine(Connection(address=engine.address))
    app = build_app(
        QueueStats(db),
        CallerRegistry(engine_tokens.callers_file),
        console=build_console(console_engine, SECRET),
    )
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="https://console.example.org"
    ) as http:
        signed = await sign_in(http, engine_tokens.operator)
        cookie = next(h for h in signed.headers.get_list("set-cookie") if h.startswith(COOKIE + "="))
        assert "secure" in cookie.lower()
        refused = await http.post("/console/logout", data={})
        assert refused.status_code == 403
    # A sign-in without its double-submitted form token is refused before the engine is asked.
    async with httpx2.AsyncClient(
        transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1"
    ) as http:
        bare = await http.post("/console/login", data={"token": engine_tokens.operator, "csrf": "guess"})
        assert bare.status_code == 403 and COOKIE + "=" not in bare.headers.get("set-cookie", "")
    await console_engine.close()


async def test_an_altered_or_foreign_cookie_is_no_session(client, engine_tokens) -> None:  # type: ignore[no-untyped-def]
    await sign_in(client, engine_tokens.operator)
    sealed = client.cookies[COOKIE]
    altered = sealed[:-4] + ("AAAA" if not sealed.endswith("AAAA") else "BBBB")
    client.cookies.clear()
    client.cookies.set(COOKIE, altered)
    assert (await client.get("/console/instances")).headers["location"] == "/console/login"
    foreign = Sealer(b"another-deployment-secret-long-enough-x")
    client.cookies.clear()
    client.cookies.set(COOKIE, foreign.seal(foreign.new(engine_tokens.operator, frozenset({"operator"}))))
    assert (await client.get("/console/instances")).headers["location"] == "/console/login"
    # An approver's session that claims the operator role still gets only what the engine allows.
    own = Sealer(SECRET)
    client.cookies.clear()
    client.cookies.set(COOKIE, own.seal(own.new(engine_tokens.approver, frozenset({"operator"}))))
    assert (await client.get("/console/instances")).status_code == 403


async def test_an_operator_resolves_an_incident_with_a_reason(client, engine, engine_tokens) -> None:  # type: ignore[no-untyped-def]
    await deploy(engine, FAILING)
    started = await engine.processes.StartInstance(process_pb2.StartInstanceRequest(process_id="billing"))
    [task] = await fetch(engine, "w", "billing")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            error_message="card declined",
            no_retry=True,
        )
    )
    await sign_in(client, engine_tokens.operator)
    listed = await client.get("/console/incidents")
    assert "card declined" in listed.text
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    # FAILED_TASK offers retry and cancel; the answers about a write belong to TOOL_OUTCOME_UNKNOWN.
    assert 'value="RETRY"' in listed.text and 'value="HAPPENED"' not in listed.text
    without_reason = await client.post(
        f"/console/incidents/{incident.id}/resolve",
        data={"csrf": csrf_of(listed.text), "resolution": "RETRY", "comment": ""},
    )
    assert without_reason.status_code == 400
    done = await client.post(
        f"/console/incidents/{incident.id}/resolve",
        data={
            "csrf": csrf_of(listed.text),
            "resolution": "RETRY",
            "comment": "card replaced",
            "back": "/incidents",
        },
    )
    assert done.status_code == 303
    [resolved] = (
        await engine.incidents.ListIncidents(
            incident_pb2.ListIncidentsRequest(state=incident_pb2.INCIDENT_STATE_RESOLVED)
        )
    ).incidents
    assert resolved.id == incident.id and resolved.resolution == "RETRY"
    assert [t.instance_id for t in await fetch(engine, "w", "billing")] == [started.instance.id]


async def test_an_instance_page_lists_every_branch_token(client, engine, engine_tokens) -> None:  # type: ignore[no-untyped-def]
    await deploy(
        engine,
        """
processes:
  - id: forked
    start: fork
    nodes:
      - { id: fork, type: parallel, branches: [left, right] }
      - { id: left, type: service, topic: left, next: both }
      - { id: right, type: service, topic: right, next: both }
      - { id: both, type: join, next: done }
      - { id: done, type: end }
""",
    )
    started = await engine.processes.StartInstance(process_pb2.StartInstanceRequest(process_id="forked"))
    await sign_in(client, engine_tokens.operator)
    page = await client.get(f"/console/instances/{started.instance.id}")
    assert re.search(r'id="active-nodes">left, right<', page.text), page.text


async def test_an_instance_page_lists_its_called_instances(client, engine, engine_tokens) -> None:  # type: ignore[no-untyped-def]
    await deploy(
        engine,
        """
processes:
  - id: child
    start: work
    nodes:
      - { id: work, type: service, topic: child-work, next: done }
      - { id: done, type: end }
  - id: parent
    start: call_child
    nodes:
      - { id: call_child, type: call, process: child, next: done }
      - { id: done, type: end }
""",
    )
    started = await engine.processes.StartInstance(process_pb2.StartInstanceRequest(process_id="parent"))
    [child] = started.instance.children
    await sign_in(client, engine_tokens.operator)
    page = await client.get(f"/console/instances/{started.instance.id}")
    assert "Called instances" in page.text and f'/instances/{child.instance_id}"' in page.text, page.text
    child_page = await client.get(f"/console/instances/{child.instance_id}")
    assert f'/instances/{started.instance.id}"' in child_page.text


async def test_a_user_task_is_completed_with_a_form_from_the_reviewed_output_schema(  # type: ignore[no-untyped-def]
    client, engine, engine_tokens
) -> None:
    await deploy(engine, REVIEWED)
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id="triage_review", variables=struct({"customerId": "C-42"}))
    )
    [task] = await fetch(engine, "w", "abada:agent")
    await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            variables=struct({"triage": {"oops": 1}}),
        )
    )
    [user_task] = (await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest())).user_tasks
    await sign_in(client, engine_tokens.operator)
    page = await client.get(f"/console/user-tasks/{user_task.id}")
    assert page.status_code == 200
    assert (
        'name="field.priority"' in page.text and "<option" in page.text and 'name="field.refund"' in page.text
    )
    token = csrf_of(page.text)
    wrong = await client.post(
        f"/console/user-tasks/{user_task.id}",
        data={"csrf": token, "field.ticketId": "", "field.priority": "high", "field.refund": "lots"},
    )
    assert wrong.status_code == 422 and "a number" in wrong.text
    done = await client.post(
        f"/console/user-tasks/{user_task.id}",
        data={"csrf": token, "field.ticketId": "T-981", "field.priority": "high", "field.refund": "12.5"},
    )
    assert done.status_code == 303
    ended = (
        await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=started.instance.id))
    ).instance
    assert ended.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(ended.variables)["triage"] == {"ticketId": "T-981", "priority": "high", "refund": 12.5}


async def test_an_unknown_write_is_answered_it_happened_with_its_result(
    client, engine, engine_tokens, crm
) -> None:  # type: ignore[no-untyped-def]
    task, incident = await _unknown_outcome_incident(engine, crm)
    assert incident.type == "TOOL_OUTCOME_UNKNOWN"
    await sign_in(client, engine_tokens.operator)
    page = await client.get(f"/console/instances/{incident.instance_id}")
    # The call in question, and every answer its type allows.
    assert "Did this call happen?" in page.text and "Parcel not received" in page.text
    for resolution in ("HAPPENED", "DID_NOT_HAPPEN", "RETRY", "CANCEL_INSTANCE"):
        assert f'value="{resolution}"' in page.text
    not_json = await client.post(
        f"/console/incidents/{incident.id}/resolve",
        data={
            "csrf": csrf_of(page.text),
            "resolution": "HAPPENED",
            "result": "{oops",
            "comment": "seen in the CRM",
        },
    )
    assert not_json.status_code == 400
    done = await client.post(
        f"/console/incidents/{incident.id}/resolve",
        data={
            "csrf": csrf_of(page.text),
            "resolution": "HAPPENED",
            "result": '{"structuredContent": {"ticketId": "T-981"}}',
            "comment": "T-981 is in the CRM",
            "back": f"/instances/{incident.instance_id}",
        },
    )
    assert done.status_code == 303 and done.headers["location"].startswith(
        f"/console/instances/{incident.instance_id}"
    )
    write = [s for s in await journal(engine, task.id) if s.sequence == 4]
    assert plain(write[0].request) == WRITE
    assert plain(write[0].response) == {"structuredContent": {"ticketId": "T-981"}}
