"""What the security review looked for and did not find stays not found.

VerifyLease limited to the broker role (test_engine_auth), SafeLoader
(test_engine_hostile_definitions), pod security and worker pods unable to reach PostgreSQL or Vault
(tests/chart) have their tests elsewhere; these are the rest: SQL built only from constants, tokens
compared in constant time, and no redirect followed with a credential.
"""

from __future__ import annotations

import ast
import hmac
import http.server
import pathlib
import threading

import grpc
import pytest
import yaml
from abada.engine.v1 import external_task_pb2
from abada_broker.auth import TokenFileCallers
from abada_engine.auth import CallerRegistry, token_sha256
from engine_helpers import ONE_SERVICE_TASK, complete, deploy, error_info, fetch, start

ENGINE_SOURCE = pathlib.Path(__file__).resolve().parents[2] / "services" / "engine" / "src" / "abada_engine"
# Calls whose first argument becomes SQL text.
_SQL_CALLS = {"text", "execute", "exec_driver_sql", "HandWritten"}


def _sql_built_at_run_time(tree: ast.AST) -> list[int]:
    """Lines inside functions where SQL text is formatted from values (f-string, %, +, .format)."""
    lines = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for call in ast.walk(function):
            if not isinstance(call, ast.Call) or not call.args:
                continue
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if name not in _SQL_CALLS:
                continue
            argument = call.args[0]
            formatted = isinstance(argument, ast.JoinedStr | ast.BinOp) or (
                isinstance(argument, ast.Call)
                and isinstance(argument.func, ast.Attribute)
                and argument.func.attr == "format"
            )
            if formatted:
                lines.append(call.lineno)
    return lines


def test_sql_is_built_only_from_constants():
    checked = 0
    offenders = []
    for path in sorted(ENGINE_SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        checked += 1
        offenders += [f"{path.relative_to(ENGINE_SOURCE)}:{line}" for line in _sql_built_at_run_time(tree)]
    assert checked > 20
    assert offenders == [], "SQL formatted at run time (use bound parameters): " + ", ".join(offenders)


def test_the_sql_check_can_fail():
    sample = ast.parse("async def f(conn, name):\n    await conn.execute(text(f'SELECT {name}'))\n")
    assert _sql_built_at_run_time(sample) == [2]


@pytest.fixture
def counted_compare_digest(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    return calls


def test_bearer_tokens_are_compared_in_constant_time(tmp_path, counted_compare_digest):
    engine_file = tmp_path / "engine-callers.yaml"
    engine_file.write_text(
        yaml.safe_dump(
            {"callers": [{"identity": "ops", "roles": ["operator"], "token_sha256": token_sha256("t")}]}
        )
    )
    assert CallerRegistry(engine_file).by_token("t").identity == "ops"
    assert CallerRegistry(engine_file).by_token("wrong") is None
    engine_calls = len(counted_compare_digest)
    assert engine_calls >= 2

    broker_file = tmp_path / "broker-callers.yaml"
    broker_file.write_text(
        yaml.safe_dump(
            {"callers": [{"identity": "pool", "roles": ["worker"], "token_sha256": token_sha256("w")}]}
        )
    )
    assert TokenFileCallers(broker_file).authenticate("w").identity == "pool"
    assert len(counted_compare_digest) > engine_calls


async def test_a_lease_token_is_compared_in_constant_time(engine, counted_compare_digest):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    with pytest.raises(grpc.aio.AioRpcError):
        await engine.tasks.ExtendLease(
            external_task_pb2.ExtendLeaseRequest(
                task_id=task.id, worker_id="w", lease_token="not-the-token", lease_ms=5000
            )
        )
    assert (32, 32) in counted_compare_digest  # two SHA-256 digests, compared in constant time
    await complete(engine, task, "w", {})


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str]]
    redirect_to = ""

    def _answer(self) -> None:
        self.seen.append((self.path, self.headers.get("Authorization", "")))
        if self.redirect_to:
            self.send_response(307)
            self.send_header("Location", self.redirect_to)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(redirect_to: str = "") -> tuple[http.server.ThreadingHTTPServer, list[tuple[str, str]]]:
    seen: list[tuple[str, str]] = []
    handler = type("Handler", (_Recorder,), {"seen": seen, "redirect_to": redirect_to})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


async def test_deploy_follows_no_redirect_and_the_credential_goes_nowhere_else(engine, deploy_credentials):
    elsewhere, seen_elsewhere = _serve()
    target = f"http://127.0.0.1:{elsewhere.server_address[1]}/mcp"
    redirector, seen_redirector = _serve(redirect_to=target)
    try:
        deploy_credentials.write_text("crm-token: the-secret-value\n")
        bundle = f"""
tool_servers:
  - name: crm
    transport: streamable-http
    url: http://127.0.0.1:{redirector.server_address[1]}/mcp
    credential: crm-token
    tools:
      get_customer: {{ policy: read }}
processes:
  - id: p
    start: a
    nodes:
      - {{ id: a, type: agent, model: gemini-m, prompt: p, tools: [crm/get_customer], result_variable: r, next: done }}
      - {{ id: done, type: end }}
"""
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await deploy(engine, bundle)
        assert error_info(caught.value).reason == "TOOL_SERVER_UNAVAILABLE"
        assert seen_redirector and all(auth == "Bearer the-secret-value" for _, auth in seen_redirector)
        assert seen_elsewhere == []  # the redirect was not followed: the secret reached nobody else
    finally:
        for server in (elsewhere, redirector):
            server.shutdown()
            server.server_close()
