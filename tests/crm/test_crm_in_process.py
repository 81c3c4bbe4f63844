"""build_app serves the same CRM inside the caller's own event loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import uvicorn
from crm_mcp.app import build_app
from crm_mcp_client import call_tool, crm_session, result_json


async def test_build_app_serves_the_crm_in_process(tmp_path: Path) -> None:
    app = build_app(tmp_path / "crm.sqlite3", token="in-process-token")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), "uvicorn stopped before it started"
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with crm_session(f"http://127.0.0.1:{port}/mcp", "in-process-token") as session:
            alice = result_json(await call_tool(session, "get_customer", {"customerId": "C-42"}))
            ticket = result_json(
                await call_tool(
                    session, "create_ticket", {"customerId": "C-42", "subject": "Parcel", "priority": "high"}
                )
            )
    finally:
        server.should_exit = True
        await serving

    assert alice["tier"] == "gold"
    assert ticket["ticketId"] == "T-981"
