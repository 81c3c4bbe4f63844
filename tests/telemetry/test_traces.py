"""One trace per task attempt across engine, worker (model and tool spans), MCP server and broker.

`make demo` runs as it is, with only the standard OTEL_* variables pointing its services at an OTLP/HTTP
receiver in this test; the receiver decodes the exports with opentelemetry-proto.
"""

from __future__ import annotations

import asyncio
import os
import pathlib
import secrets
import sys

import asyncpg
from otlp_receiver import OtlpReceiver

ROOT = pathlib.Path(__file__).resolve().parents[2]


async def _scratch_database(admin_url: str) -> tuple[str, str]:
    name = f"abada_traces_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    base, _, query = admin_url.partition("?")
    return name, base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")


async def _drop(admin_url: str, name: str) -> None:
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def test_alices_task_is_one_trace_across_engine_worker_mcp_server_and_broker():
    admin_url = os.environ.get("ABADA_TEST_DATABASE_URL")
    database = await _scratch_database(admin_url) if admin_url else None
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("OTEL_") and key not in ("ABADA_DATABASE_URL", "GEMINI_API_KEY")
    }
    try:
        with OtlpReceiver() as receiver:
            env.update(
                {
                    "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                    "OTEL_BSP_SCHEDULE_DELAY": "100",
                }
            )
            if database is not None:
                env["ABADA_DATABASE_URL"] = database[1]
            demo = await asyncio.create_subprocess_exec(
                sys.executable,
                str(ROOT / "examples" / "demo.py"),
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await asyncio.wait_for(demo.communicate(), 300)
            printed = output.decode(errors="replace")
            assert demo.returncode == 0, printed
            assert "is COMPLETED; the token is at: done" in printed
            spans = list(receiver.spans)
    finally:
        if database is not None:
            await _drop(admin_url, database[0])

    # The demo runs Alice's triage first, then a second triage under approval (two more
    # attempts): the earliest lease of the agent topic is Alice's one attempt.
    leases = [s for s in spans if s.service == "abada-engine" and s.name == "lease abada:agent"]
    assert len(leases) >= 1, sorted({(s.service, s.name) for s in spans})
    lease = min(leases, key=lambda s: s.start_time_unix_nano)
    trace = [s for s in spans if s.trace_id == lease.trace_id]
    by_service: dict[str, list[str]] = {}
    for span in trace:
        by_service.setdefault(span.service, []).append(span.name)
    engine = by_service.get("abada-engine", [])
    assert any(name.endswith("ExternalTaskService/FetchAndLock") for name in engine), by_service
    assert any(name.endswith("ExternalTaskService/AppendStep") for name in engine), by_service
    assert any(name.endswith("ExternalTaskService/Complete") for name in engine), by_service

    worker = [s for s in trace if s.service == "abada-worker"]
    models = [s for s in worker if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(models) == 3, by_service
    for model in models:
        assert model.attributes["gen_ai.request.model"] == "gemini-3.6-flash"
        assert model.attributes["gen_ai.usage.input_tokens"] > 0
        assert model.attributes["gen_ai.usage.output_tokens"] > 0
    tools = {
        s.attributes.get("gen_ai.tool.name")
        for s in worker
        if s.attributes.get("gen_ai.operation.name") == "execute_tool"
    }
    assert tools == {"get_customer", "create_ticket"}, by_service

    mcp = [s for s in trace if s.service == "abada-demo-crm"]
    assert {s.attributes.get("gen_ai.tool.name") for s in mcp if s.name.startswith("tools/call")} == {
        "get_customer",
        "create_ticket",
    }, by_service
    broker = by_service.get("abada-broker", [])
    assert any(name.endswith("GetToolCredential") for name in broker), by_service
    # The broker asked the engine about the lease inside the same trace.
    assert any(name.endswith("LeaseService/VerifyLease") for name in engine), by_service
    # Every span of the attempt hangs off another span of it, back to the engine's FetchAndLock.
    ids = {s.span_id for s in trace}
    roots = [s for s in trace if s.parent_span_id not in ids]
    assert len(roots) == 1, [(s.service, s.name) for s in roots]
