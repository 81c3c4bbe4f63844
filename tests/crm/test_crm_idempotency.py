"""create_ticket honours idempotency keys from the Idempotency-Key header and from _meta.idempotencyKey."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from crm_mcp.testing import RunningCrmServer
from crm_mcp_client import call_tool, crm_session, result_json, result_text

PARCEL_TICKET = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


def fresh_key() -> str:
    return f"key-{uuid.uuid4()}"


def tickets_under(crm: RunningCrmServer, key: str) -> list[dict[str, object]]:
    return [ticket for ticket in crm.tickets() if ticket["idempotencyKey"] == key]


@pytest.mark.parametrize("carrier", ["header", "meta", "both"])
async def test_the_same_key_twice_creates_one_ticket_and_returns_it_again(
    crm: RunningCrmServer, carrier: str
) -> None:
    key = fresh_key()
    keys = {"header_key": key if carrier in ("header", "both") else None}
    keys["meta_key"] = key if carrier in ("meta", "both") else None
    total_before = len(crm.tickets())

    async with crm_session(crm.url, crm.token) as session:
        first = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET, **keys))
    # A new session, as a worker that took over after a crash would open.
    async with crm_session(crm.url, crm.token) as session:
        retry = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET, **keys))

    assert retry == first
    assert [ticket["ticketId"] for ticket in tickets_under(crm, key)] == [first["ticketId"]]
    assert len(crm.tickets()) == total_before + 1


async def test_without_a_key_every_call_creates_a_ticket(crm: RunningCrmServer) -> None:
    total_before = len(crm.tickets())
    async with crm_session(crm.url, crm.token) as session:
        first = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET))
        second = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET))

    assert first["ticketId"] != second["ticketId"]
    assert len(crm.tickets()) == total_before + 2


@pytest.mark.parametrize(
    "changed",
    [{"priority": "urgent"}, {"subject": "Something else"}, {"customerId": "C-7"}],
)
async def test_the_same_key_with_different_arguments_is_refused(
    crm: RunningCrmServer, changed: dict[str, str]
) -> None:
    key = fresh_key()
    async with crm_session(crm.url, crm.token) as session:
        original = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET, header_key=key))
        refused = await call_tool(session, "create_ticket", PARCEL_TICKET | changed, header_key=key)

    assert refused.is_error is True
    message = result_text(refused)
    assert key in message
    assert f"differs in: {next(iter(changed))}" in message
    assert [ticket["ticketId"] for ticket in tickets_under(crm, key)] == [original["ticketId"]]


async def test_header_and_meta_carrying_different_keys_are_refused(crm: RunningCrmServer) -> None:
    header_key, meta_key = fresh_key(), fresh_key()
    total_before = len(crm.tickets())
    async with crm_session(crm.url, crm.token) as session:
        refused = await call_tool(
            session, "create_ticket", PARCEL_TICKET, header_key=header_key, meta_key=meta_key
        )

    assert refused.is_error is True
    assert "Conflicting idempotency keys" in result_text(refused)
    assert len(crm.tickets()) == total_before


async def test_concurrent_calls_with_one_key_create_one_ticket(crm: RunningCrmServer) -> None:
    key = fresh_key()
    async with (
        crm_session(crm.url, crm.token) as first_session,
        crm_session(crm.url, crm.token) as second_session,
    ):
        results = await asyncio.gather(
            *(
                call_tool(session, "create_ticket", PARCEL_TICKET, header_key=key, meta_key=key)
                for session in (first_session, second_session, first_session, second_session)
            )
        )

    ticket_ids = {result_json(result)["ticketId"] for result in results}
    assert len(ticket_ids) == 1
    assert [ticket["ticketId"] for ticket in tickets_under(crm, key)] == list(ticket_ids)


async def test_a_non_string_meta_key_is_refused(crm: RunningCrmServer) -> None:
    total_before = len(crm.tickets())
    async with crm_session(crm.url, crm.token) as session:
        refused = await session.call_tool("create_ticket", PARCEL_TICKET, meta={"idempotencyKey": 42})

    assert refused.is_error is True
    assert "must be a string" in result_text(refused)
    assert len(crm.tickets()) == total_before
