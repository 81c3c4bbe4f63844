"""Contract variants: a CRM whose tools changed after deploy, at start-up and switched live."""

from __future__ import annotations

import urllib.error

import pytest
from crm_mcp.testing import running_crm_server
from crm_mcp_client import call_tool, crm_session, result_json, result_text
from mcp.client.session import ClientSession
from mcp_types import Tool

PARCEL_TICKET = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


async def tools_by_name(session: ClientSession) -> dict[str, Tool]:
    return {tool.name: tool for tool in (await session.list_tools()).tools}


async def test_no_create_ticket_variant_offers_only_the_lookup() -> None:
    with running_crm_server(variant="no-create-ticket") as crm:
        async with crm_session(crm.url, crm.token) as session:
            tools = await tools_by_name(session)
            refused = await call_tool(session, "create_ticket", PARCEL_TICKET)
        stored = crm.tickets()

    assert set(tools) == {"get_customer"}
    assert refused.is_error is True
    assert "Unknown tool" in result_text(refused)
    assert stored == []


async def test_changed_schema_variant_requires_a_channel() -> None:
    with running_crm_server(variant="changed-schema") as crm:
        async with crm_session(crm.url, crm.token) as session:
            schema = (await tools_by_name(session))["create_ticket"].input_schema
            without_channel = await call_tool(session, "create_ticket", PARCEL_TICKET)
            with_channel = result_json(
                await call_tool(session, "create_ticket", PARCEL_TICKET | {"channel": "email"})
            )

    assert sorted(schema["required"]) == ["channel", "customerId", "priority", "subject"]
    assert without_channel.is_error is True
    assert "channel" in result_text(without_channel)
    assert with_channel["ticketId"] == "T-981"
    assert with_channel["channel"] == "email"


async def test_changed_description_variant_rewrites_only_the_description() -> None:
    with running_crm_server(variant="standard") as standard_crm:
        async with crm_session(standard_crm.url, standard_crm.token) as session:
            standard = (await tools_by_name(session))["create_ticket"]
    with running_crm_server(variant="changed-description") as crm:
        async with crm_session(crm.url, crm.token) as session:
            changed = (await tools_by_name(session))["create_ticket"]
            created = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET))

    assert changed.input_schema == standard.input_schema
    assert changed.description != standard.description
    assert "urgent" in (changed.description or "")
    assert created["ticketId"] == "T-981"


async def test_the_control_endpoint_switches_the_variant_live_within_one_session() -> None:
    with running_crm_server(enable_control=True) as crm:
        async with crm_session(crm.url, crm.token) as session:
            standard = await tools_by_name(session)
            crm.set_variant("changed-schema")
            changed = await tools_by_name(session)
            crm.set_variant("no-create-ticket")
            withdrawn = await tools_by_name(session)
            crm.set_variant("standard")
            restored = await tools_by_name(session)
            created = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET))

    assert "channel" not in standard["create_ticket"].input_schema["properties"]
    assert "channel" in changed["create_ticket"].input_schema["required"]
    assert set(withdrawn) == {"get_customer"}
    assert restored["create_ticket"].input_schema == standard["create_ticket"].input_schema
    assert created["ticketId"] == "T-981"


async def test_the_control_endpoint_does_not_exist_unless_enabled() -> None:
    with running_crm_server() as crm:
        with pytest.raises(urllib.error.HTTPError) as missing:
            crm.set_variant("no-create-ticket")
        async with crm_session(crm.url, crm.token) as session:
            tools = await tools_by_name(session)

    assert missing.value.code == 404
    assert set(tools) == {"get_customer", "create_ticket"}


async def test_a_reset_empties_the_crm_as_if_it_had_just_started() -> None:
    """The test control a shared CRM is reset with before every worker test: nothing carries over."""
    with running_crm_server(enable_control=True) as crm:
        async with crm_session(crm.url, crm.token) as session:
            first = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET, header_key="key-1"))
            await call_tool(session, "get_customer", {"customerId": "C-42"})
        crm.set_variant("no-create-ticket")
        crm.reset(read_latency_ms=300)
        assert (crm.tickets(), crm.calls()) == ([], [])
        async with crm_session(crm.url, crm.token) as session:
            assert set(await tools_by_name(session)) == {"get_customer", "create_ticket"}
            # The same key opens a new ticket, numbered as the first one was: the key was forgotten.
            again = result_json(await call_tool(session, "create_ticket", PARCEL_TICKET, header_key="key-1"))
            await call_tool(session, "get_customer", {"customerId": "C-42"})
        [lookup] = [call for call in crm.calls() if call["tool"] == "get_customer"]
        stored = crm.tickets()
        with pytest.raises(urllib.error.HTTPError) as refused:
            crm._request("POST", "/_control/reset", {"read_latency_ms": -1})

    assert again["ticketId"] == first["ticketId"]
    assert [ticket["idempotencyKey"] for ticket in stored] == ["key-1"]
    # The latency was applied: 300 ms, give or take the millisecond uvicorn's loop (uvloop: libuv's
    # clock, in whole milliseconds and read once per turn of the loop) may end a sleep early by the
    # wall clock. Seen once under two CPU hogs: 0.29988 s.
    assert lookup["finished"] - lookup["started"] >= 0.295
    assert refused.value.code == 400
