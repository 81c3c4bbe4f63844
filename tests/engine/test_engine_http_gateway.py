"""The engine's HTTP/JSON side: every RPC has an HTTP rule, the OpenAPI document follows the protos, and
the HTTP side refuses what gRPC refuses, as a 4xx naming the field, never a 5xx.

The engine is the suite's, its HTTP side over the same servicers (tests/conftest.py `engine_http`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import importlib
import json
import os
import pathlib
import pkgutil
import random
import re
import secrets
import socket
import subprocess
import sys
from typing import Any
from urllib.parse import quote

import abada.broker.v1
import abada.engine.v1
import grpc
import httpx2
import pytest
import test_engine_error_bounds
from abada_common.http_gateway import HTTP_STATUS, MAX_JSON_DEPTH, bindings, http_rules
from abada_engine.api.server import GRPC_MAX_MESSAGE_BYTES, SERVICE_DESCRIPTORS
from engine_helpers import GREET, deploy, fetch, start
from google.protobuf import json_format

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _all_services() -> list[Any]:
    """Every service of every generated module of abada.engine.v1 and abada.broker.v1."""
    services = []
    for package in (abada.engine.v1, abada.broker.v1):
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.endswith("_pb2"):
                generated = importlib.import_module(f"{package.__name__}.{module.name}")
                services += list(generated.DESCRIPTOR.services_by_name.values())
    return services


def test_every_rpc_of_every_service_has_an_http_rule_and_no_two_collide():
    services = _all_services()
    assert len(services) >= 9
    missing = [f"{s.full_name}.{m.name}" for s in services for m in s.methods if not http_rules(m)]
    assert missing == []
    # Engine and broker listen apart; within each, no two operations share a method and a path.
    engine_names = {s.full_name for s in SERVICE_DESCRIPTORS}
    assert {s.full_name for s in services if s.full_name.startswith("abada.engine.")} == engine_names
    for group in (
        [s for s in services if s.full_name in engine_names],
        [s for s in services if s not in SERVICE_DESCRIPTORS],
    ):
        seen = [(b.http_method, b.path.openapi_path) for b in bindings(group)]
        assert len(seen) == len(set(seen))


def test_the_scenario_paths_are_the_rules_of_append_step_and_get_tool_credential():
    found = {b.method.name: (b.http_method, b.path.template, b.body) for b in bindings(_all_services())}
    assert found["AppendStep"] == ("POST", "/v1/external-tasks/{task_id}/steps", "*")
    assert found["GetToolCredential"] == ("GET", "/v1/external-tasks/{task_id}/tool-credentials/{server}", "")


def test_the_checked_in_openapi_documents_are_what_the_protos_say():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_openapi.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def _client(base_url: str, token: str) -> httpx2.AsyncClient:
    return httpx2.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=20)


async def test_openapi_is_served_with_the_security_scheme_and_every_error(engine, engine_http, engine_tokens):
    async with _client(engine_http, engine_tokens.operator) as client:
        served = (await client.get("/v1/openapi.json")).json()
    checked_in = json.loads((ROOT / "api" / "openapi" / "engine.openapi.json").read_text())
    assert served == checked_in
    assert served["openapi"] == "3.1.0"
    assert served["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    append = served["paths"]["/v1/external-tasks/{task_id}/steps"]["post"]
    assert {"400", "401", "403", "404", "409", "429", "500", "503"} <= set(append["responses"])


async def test_short_enum_names_query_parameters_and_the_scenario_body(engine, engine_http, engine_tokens):
    await deploy(engine, GREET)
    instance = await start(engine, "greet", customerId="C-42")
    await start(engine, "greet", customerId="C-7")
    async with _client(engine_http, engine_tokens.operator) as client:
        # Filters a query cannot carry (a list of messages) go in a POST body, on the rule's second path.
        search = await client.post(
            "/v1/instances:search", json={"variables": [{"name": "customerId", "value": "C-42"}]}
        )
        assert [i["id"] for i in search.json()["instances"]] == [instance.id], search.text
        for state in ("ACTIVE", "INSTANCE_STATE_ACTIVE"):
            listed = await client.get("/v1/instances", params={"processId": "greet", "state": state})
            assert listed.status_code == 200, listed.text
            assert instance.id in [i["id"] for i in listed.json()["instances"]]
        # snake_case names are taken too, as grpc-gateway takes them.
        done = await client.get("/v1/instances", params={"process_id": "greet", "state": "COMPLETED"})
        assert done.status_code == 200 and done.json().get("instances", []) == []
        unknown = await client.get("/v1/instances", params={"state": "SLEEPING"})
        assert unknown.status_code == 400
        assert unknown.json()["details"][0]["metadata"]["field"] == "state"


async def test_refusals_keep_their_status_info_and_challenge(engine, engine_http, engine_tokens):
    async with httpx2.AsyncClient(base_url=engine_http, timeout=10) as anonymous:
        refused = await anonymous.get("/v1/instances")
        assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == "Bearer"
        assert refused.json()["details"][0]["reason"] == "UNAUTHENTICATED"
    async with _client(engine_http, engine_tokens.worker_pool) as worker:
        refused = await worker.get("/v1/instances")
        assert refused.status_code == 403
        assert refused.json()["details"][0]["reason"] == "ROLE_REQUIRED"
    async with _client(engine_http, engine_tokens.operator) as client:
        missing = await client.get("/v1/instances/01234567-89ab-cdef-0123-456789abcdef")
        assert missing.status_code == 404 and missing.json()["code"] == grpc.StatusCode.NOT_FOUND.value[0]
        assert (await client.get("/v1/nowhere")).status_code == 404
        assert (await client.delete("/v1/instances")).status_code == 405


async def test_the_limits_of_the_grpc_port_hold_over_http(engine, engine_http, engine_tokens):
    async with _client(engine_http, engine_tokens.suite) as client:
        huge = await client.post(
            "/v1/definitions", content=b'{"content": "' + b"x" * GRPC_MAX_MESSAGE_BYTES + b'"}'
        )
        assert huge.status_code == 413
        deep: Any = "x"
        for _ in range(MAX_JSON_DEPTH + 1):
            deep = {"a": deep}
        nested = await client.post("/v1/processes/greet/instances", json={"variables": deep})
        assert nested.status_code == 400 and "deeper" in nested.json()["message"]
        typed = await client.post(
            "/v1/external-tasks/x/steps", json={"workerId": "w", "attempt": "one", "kind": "TOOL_CALL"}
        )
        assert typed.status_code == 400
        assert typed.json()["details"][0]["metadata"]["field"] == "attempt"
        stray = await client.post("/v1/external-tasks/x/steps", json={"workerId": "w", "colour": "red"})
        assert stray.status_code == 400 and stray.json()["details"][0]["metadata"]["field"] == "colour"
        bad_json = await client.post("/v1/external-tasks/x/steps", content=b"{not json")
        assert bad_json.status_code == 400


class _Recorder:
    """Stands in for the gRPC clients of a test's cases: records which RPC each case calls, with what."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def __getattr__(self, _service: str) -> Any:
        recorder = self

        class _Stub:
            def __getattr__(self, method: str) -> Any:
                async def call(request: Any) -> None:
                    recorder.calls.append((method, request))

                return call

        return _Stub()


def _route(method_name: str) -> Any:
    return next(b for b in bindings(SERVICE_DESCRIPTORS) if b.method.name == method_name and b.index == 0)


async def _send(client: httpx2.AsyncClient, method_name: str, request: Any) -> httpx2.Response:
    """`request` (a gRPC request message) sent over the RPC's HTTP rule, as a caller using curl would."""
    route = _route(method_name)
    data = json_format.MessageToDict(request)
    path = route.path.template
    for name in route.path.fields:
        value = data.pop(route.method.input_type.fields_by_name[name].json_name, "") or "-"
        path = path.replace("{" + name + "}", quote(value, safe=""))
    if route.body:
        return await client.request(route.http_method, path, json=data)
    return await client.request(route.http_method, path, params=data)


async def test_the_huge_input_cases_of_the_grpc_side_answer_alike_over_http(
    engine, engine_http, engine_tokens
):
    async with _client(engine_http, engine_tokens.suite) as client:
        for name, call, code in test_engine_error_bounds.CASES:
            recorder = _Recorder()
            await call(recorder)
            [(method, request)] = recorder.calls
            answer = await _send(client, method, request)
            assert answer.status_code == HTTP_STATUS[code], (name, answer.status_code, answer.text[:300])
            body = answer.json()
            assert body["code"] == code.value[0]
            assert body["details"][0]["domain"] == "abada.dev" and body["details"][0]["reason"]
            assert len(answer.content) < 8 * 1024


def _wrong_values(rng: random.Random) -> list[Any]:
    return [
        None,
        True,
        -1,
        2**70,
        1e308,
        "",
        "\x00",
        "ü" * 300,
        "x" * 20_000,
        [],
        [1, "a", None],
        {},
        {"nested": {"deeper": [1, 2, {"x": None}]}},
        rng.randbytes(8).hex(),
    ]


@pytest.mark.timeout(120)
async def test_malformed_requests_to_every_operation_are_4xx_and_the_engine_stays_up(
    engine, engine_http, engine_tokens
):
    """The HTTP side of the malformed-request fuzz: for every operation, every field set to values of the
    wrong type, size or shape, bodies that are not JSON objects, and random bytes: never a 5xx."""
    await deploy(engine, GREET)
    await start(engine, "greet")
    rng = random.Random(25)
    server_errors: list[tuple[str, str, int, str]] = []
    sent = 0
    async with _client(engine_http, engine_tokens.suite) as client:
        for route in bindings(SERVICE_DESCRIPTORS):
            path = route.path.template
            for name in route.path.fields:
                path = path.replace(
                    "{" + name + "}",
                    rng.choice(["x", "00000000-0000-0000-0000-000000000000", "%00", "..", "a%2Fb"]),
                )
            attempts: list[dict[str, Any]] = []
            for found in route.method.input_type.fields:
                for value in rng.sample(_wrong_values(rng), 5):
                    attempts.append(
                        {"json": {found.json_name: value}}
                        if route.body
                        else {"params": {found.json_name: str(value)[:2000]}}
                    )
            if route.body:
                attempts += [
                    {"content": b"[1, 2]"},
                    {"content": b'"text"'},
                    {"content": b"{"},
                    {"content": rng.randbytes(64)},
                    {"content": b"{" * 5000},
                    {"content": b'{"variables": {"x": NaN}, "request": {"y": -Infinity}, "attempt": 1e999}'},
                    {"content": '{"workerId": "\\ud800", "reason": "\u0000"}'.encode()},
                    {"content": b'{"a": 1, "a": 2}'},
                ]
            for attempt in attempts:
                answer = await client.request(route.http_method, path, **attempt)
                sent += 1
                if answer.status_code >= 500:
                    server_errors.append(
                        (route.operation_id, str(attempt)[:200], answer.status_code, answer.text[:200])
                    )
    assert sent > 300
    assert server_errors == []
    async with httpx2.AsyncClient(base_url=engine_http, timeout=5) as probe:
        assert (await probe.get("/healthz")).json() == {"status": "ok"}


@pytest.mark.timeout(120)
async def test_schemathesis_finds_no_server_error_and_no_answer_outside_the_document(
    engine, engine_http, engine_tokens, tmp_path
):
    await deploy(engine, GREET)
    await start(engine, "greet")
    await fetch(engine, "w", "greetings")  # a leased task, so the task operations meet real state too
    process = await asyncio.create_subprocess_exec(
        str(pathlib.Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{engine_http}/v1/openapi.json",
        "--header",
        f"Authorization: Bearer {engine_tokens.operator}",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
        "--max-examples",
        "4",
        "--phases",
        "examples,fuzzing",
        "--seed",
        "25",
        "--no-shrink",
        "--request-timeout",
        "10",
        "--max-time",
        "20",
        "--workers",
        "1",
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={"PATH": "/usr/bin:/bin", "NO_COLOR": "1", "SCHEMATHESIS_TELEMETRY": "false"},
        # Its cache (.schemathesis/) goes here, not into the working tree.
        cwd=tmp_path,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=100)
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-6000:]
    # Every operation of the document was tried, within the time budget.
    tested = re.search(r"Tested:\s+(\d+)", text)
    assert tested is not None and int(tested.group(1)) == len(bindings(SERVICE_DESCRIPTORS)), text[-3000:]


async def test_the_path_wins_over_the_same_field_in_the_body(engine, engine_http, engine_tokens):
    await deploy(engine, GREET)
    instance = await start(engine, "greet")
    async with _client(engine_http, engine_tokens.operator) as client:
        canceled = await client.post(
            f"/v1/instances/{instance.id}:cancel", json={"instanceId": "not-this-one", "reason": "duplicate"}
        )
    assert canceled.status_code == 200, canceled.text
    assert canceled.json()["instance"]["id"] == instance.id
    assert canceled.json()["instance"]["state"] == "INSTANCE_STATE_CANCELED"


async def test_an_engine_with_the_http_api_off_serves_only_health_and_figures(database_url, tmp_path):
    """ABADA_HTTP_API=0, for where tokens must not cross the network on the plaintext HTTP port; and
    the real `abada-engine serve` otherwise serves the API there (its default)."""
    token = secrets.token_urlsafe(24)
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        "callers:\n  - identity: ops\n    roles: [operator]\n"
        f"    token_sha256: {hashlib.sha256(token.encode()).hexdigest()}\n"
    )

    async def answers(api: str) -> tuple[int, int, int]:
        http = f"127.0.0.1:{_free_port()}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
        env.update(
            ABADA_DATABASE_URL=database_url,
            ABADA_GRPC_ADDRESS=f"127.0.0.1:{_free_port()}",
            ABADA_HTTP_ADDRESS=http,
            ABADA_HTTP_API=api,
            ABADA_AUTH_TOKENS_FILE=str(callers),
            ABADA_JOURNAL_KEYS="k:" + base64.b64encode(os.urandom(32)).decode(),
            ABADA_IDEMPOTENCY_SECRET=secrets.token_urlsafe(32),
            ABADA_STATE_DIR=str(tmp_path / f"state-{api}"),
            ABADA_LOG_LEVEL="WARNING",
        )
        engine = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "abada_engine.main", "serve", env=env
        )
        try:
            async with httpx2.AsyncClient(
                base_url=f"http://{http}", headers={"Authorization": f"Bearer {token}"}, timeout=5
            ) as client:
                for _ in range(600):
                    try:
                        health = await client.get("/healthz")
                        break
                    except httpx2.TransportError:
                        assert engine.returncode is None, "the engine exited"
                        await asyncio.sleep(0.1)
                listed = await client.get("/v1/instances")
                document = await client.get("/v1/openapi.json")
            return health.status_code, listed.status_code, document.status_code
        finally:
            engine.terminate()
            await engine.wait()

    assert await answers("0") == (200, 404, 404)
    assert await answers("1") == (200, 200, 200)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_an_operator_repairs_an_instance_over_http_and_the_history_names_them(
    engine, engine_http, engine_tokens
):
    await deploy(engine, GREET)
    instance = await start(engine, "greet", customerId="C-42")
    async with _client(engine_http, engine_tokens.operator) as client:
        modified = await client.post(
            f"/v1/instances/{instance.id}:modify",
            json={"setVariables": {"customerId": "C-43"}, "reason": "typo in the id"},
        )
        assert modified.status_code == 200, modified.text
        assert modified.json()["instance"]["variables"]["customerId"] == "C-43"
        history = await client.get(f"/v1/instances/{instance.id}/history")
        [entry] = [e for e in history.json()["events"] if e["type"] == "VARIABLE_SET"]
        assert (entry["data"]["by"], entry["data"]["reason"]) == ("ops", "typo in the id")
        plan = await client.post(
            "/v1/instances:migrate", json={"processId": "greet", "fromVersion": 1, "toVersion": 1}
        )
        assert plan.status_code == 400, plan.text
