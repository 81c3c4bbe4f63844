"""Tickets and their idempotency keys live in the SQLite file, so a restarted CRM still knows them."""

from __future__ import annotations

from pathlib import Path

from crm_mcp.testing import running_crm_server
from crm_mcp_client import call_tool, crm_session, result_json

PARCEL_TICKET = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


async def test_tickets_and_keys_survive_a_restart(tmp_path: Path) -> None:
    db_path = tmp_path / "crm.sqlite3"
    with running_crm_server(db_path=db_path) as first_run:
        async with crm_session(first_run.url, first_run.token) as session:
            created = result_json(
                await call_tool(session, "create_ticket", PARCEL_TICKET, header_key="task-7f3/1/4")
            )

    with running_crm_server(db_path=db_path) as second_run:
        listed_after_restart = second_run.tickets()
        async with crm_session(second_run.url, second_run.token) as session:
            replayed = result_json(
                await call_tool(session, "create_ticket", PARCEL_TICKET, header_key="task-7f3/1/4")
            )
            next_ticket = result_json(
                await call_tool(
                    session, "create_ticket", {"customerId": "C-7", "subject": "Invoice", "priority": "low"}
                )
            )
        listed_at_end = second_run.tickets()

    assert created["ticketId"] == "T-981"
    assert [(t["ticketId"], t["idempotencyKey"]) for t in listed_after_restart] == [("T-981", "task-7f3/1/4")]
    assert replayed == created
    assert next_ticket["ticketId"] == "T-982"
    assert len(listed_at_end) == 2
