"""Alice's task with OTLP over gRPC, and what the services write to their logs while it runs.

Engine, broker and an agent worker run as real processes (tests/faults/fault_stack.py) with only the
standard variables OTEL_EXPORTER_OTLP_ENDPOINT and OTEL_EXPORTER_OTLP_PROTOCOL=grpc pointing them at a
gRPC TraceService written in this test; the receiver decodes the exports with opentelemetry-proto.
One run serves three tests: one trace for the attempt, the engine's own lines for the deploy and the
start (each inside its RPC's span), and no third-party INFO line (httpx, mcp, ...) in any service's
log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from abada.engine.v1 import process_pb2, process_pb2_grpc
from crm_mcp.testing import running_crm_server
from faults.fault_stack import AGENT_TOPIC, alice_script, running_stack, wait_for
from google.protobuf import struct_pb2
from otlp_receiver import OtlpGrpcReceiver, ReceivedSpan
from scripted_gemini.testing import running_scripted_gemini

BUSINESS_KEY = "C-42"


@dataclass
class Run:
    spans: list[ReceivedSpan]
    instance_id: str
    logs: dict[str, list[dict[str, Any]]]  # JSON lines by service: engine, broker, worker


@contextlib.asynccontextmanager
async def scratch_database(server_url: str) -> AsyncIterator[str]:
    """A database of its own on the suite's PostgreSQL: the stack's engine migrates and fills it."""
    name = f"abada_otlp_grpc_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, query = server_url.partition("?")
    try:
        yield base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")
    finally:
        conn = await asyncpg.connect(server_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def json_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


def attempt_trace(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
    """The spans of the trace that holds the engine's Complete of the agent task, or []."""
    for span in spans:
        if span.service == "abada-engine" and span.name.endswith("ExternalTaskService/Complete"):
            trace = [s for s in spans if s.trace_id == span.trace_id]
            if any(s.attributes.get("gen_ai.operation.name") == "chat" for s in trace):
                return trace
    return []


@pytest.fixture(scope="module")
async def alice_over_grpc(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    state = tmp_path_factory.mktemp("otlp-grpc")
    with contextlib.ExitStack() as servers:
        crm = servers.enter_context(running_crm_server(enable_control=True))
        gemini_url = servers.enter_context(running_scripted_gemini(alice_script()))
        receiver = servers.enter_context(OtlpGrpcReceiver())
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "ABADA_LOG_LEVEL": "INFO",
        }
        async with (
            scratch_database(database_url) as url,
            running_stack(state, url, crm, gemini_url, env=env) as stack,
        ):
            stack.add_worker("otlp-grpc", concurrency=1)
            async with stack.engine.channel() as channel:
                variables = struct_pb2.Struct()
                variables.update({"customerId": "C-42", "message": "My parcel never arrived"})
                started = await process_pb2_grpc.ProcessServiceStub(channel).StartInstance(
                    process_pb2.StartInstanceRequest(
                        process_id="support_triage", variables=variables, business_key=BUSINESS_KEY
                    ),
                    timeout=10,
                )
            try:
                await wait_for(
                    lambda: attempt_trace(receiver.snapshot()), "the attempt's spans over OTLP/gRPC", 60
                )
            except AssertionError as missing:
                raise AssertionError(f"{missing}\n{stack.logs()}") from None
            # A clean stop flushes what each exporter still holds.
            for worker in stack.workers:
                worker.stop()
            stack.broker.stop()
            stack.engine.service.stop()
            return Run(
                spans=receiver.snapshot(),
                instance_id=started.instance.id,
                logs={
                    "engine": json_lines(stack.engine.service.log),
                    "broker": json_lines(stack.broker.log),
                    "worker": json_lines(stack.workers[0].log),
                },
            )


def test_an_attempt_exported_over_otlp_grpc_is_one_trace_from_engine_to_worker(alice_over_grpc: Run) -> None:
    trace = attempt_trace(alice_over_grpc.spans)
    by_service: dict[str, list[str]] = {}
    for span in trace:
        by_service.setdefault(span.service, []).append(span.name)
    engine = by_service.get("abada-engine", [])
    assert f"lease {AGENT_TOPIC}" in engine, by_service
    assert any(name.endswith("ExternalTaskService/AppendStep") for name in engine), by_service
    worker = [s for s in trace if s.service == "abada-worker"]
    models = [s for s in worker if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(models) == 3, by_service
    assert all(m.attributes["gen_ai.request.model"] == "gemini-3.6-flash" for m in models)
    tools = {s.attributes.get("gen_ai.tool.name") for s in worker if s.attributes.get("gen_ai.tool.name")}
    assert tools == {"get_customer", "create_ticket"}, by_service
    # The broker's span for the tool credential joins the same trace, whatever the protocol.
    assert any(name.endswith("GetToolCredential") for name in by_service.get("abada-broker", [])), by_service
    ids = {s.span_id for s in trace}
    assert len([s for s in trace if s.parent_span_id not in ids]) == 1


def test_the_engine_logs_one_line_per_deploy_and_per_start_inside_their_spans(alice_over_grpc: Run) -> None:
    lines = alice_over_grpc.logs["engine"]
    (deployed,) = [line for line in lines if line.get("message") == "deployed"]
    assert deployed["level"] == "info" and deployed["service"] == "engine"
    ((definition),) = deployed["definitions"]
    assert definition["process_id"] == "support_triage" and definition["version"] == 1
    assert definition["new_version"] is True
    assert deployed["tool_servers_checked"] == ["crm"]
    (started,) = [line for line in lines if line.get("message") == "instance started"]
    assert started["instance_id"] == alice_over_grpc.instance_id
    assert started["business_key"] == BUSINESS_KEY
    assert (started["process_id"], started["version"]) == ("support_triage", 1)
    assert started["definition_id"] == definition["definition_id"]
    # Each line carries the trace id of the RPC that wrote it.
    spans = alice_over_grpc.spans
    for line, rpc in ((deployed, "DefinitionService/Deploy"), (started, "ProcessService/StartInstance")):
        (server_span,) = [s for s in spans if s.service == "abada-engine" and s.name.endswith(rpc)]
        assert line["trace_id"] == server_span.trace_id, rpc


def test_no_service_lets_third_party_info_lines_through(alice_over_grpc: Run) -> None:
    for service, lines in alice_over_grpc.logs.items():
        assert lines, f"the {service} logged nothing"
        foreign = [
            f"{line.get('logger')}: {line.get('message')}"
            for line in lines
            if line.get("level") in ("debug", "info") and not str(line.get("logger", "")).startswith("abada")
        ]
        assert foreign == [], f"{service} let through {foreign}"
    engine = alice_over_grpc.logs["engine"]
    # The deploy asked the CRM for its tools (an MCP session over httpx): those lines are gone.
    assert any(line.get("message") == "deployed" for line in engine)
    # Alembic's step-by-step lines are gone too; the engine says what it migrated, once.
    (upgraded,) = [line for line in engine if line.get("message") == "database schema upgraded"]
    assert upgraded["from_revision"] is None and upgraded["to_revision"]


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, {n: logging.getLogger(n).level for n in ("httpx", "mcp", "hvac")})
    yield
    root.handlers[:], level, levels = saved
    root.setLevel(level)
    for name, value in levels.items():
        logging.getLogger(name).setLevel(value)


@pytest.mark.usefixtures("restored_logging")
def test_debug_lets_the_libraries_speak_again() -> None:
    from abada_common.logs import JsonFormatter, configure_logging

    configure_logging(JsonFormatter("engine"), "DEBUG")
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.DEBUG
    assert logging.getLogger("mcp.client.streamable_http").getEffectiveLevel() == logging.DEBUG
    configure_logging(JsonFormatter("engine"), "INFO")
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING
    assert logging.getLogger("hvac").getEffectiveLevel() == logging.WARNING
