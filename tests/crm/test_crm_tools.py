"""The CRM's two tools as an MCP client sees them over streamable-http."""

from __future__ import annotations

import pytest
from crm_mcp.testing import RunningCrmServer, running_crm_server
from crm_mcp_client import call_tool, crm_session, result_json, result_text


async def test_tools_list_offers_both_tools_with_typed_input_schemas(crm: RunningCrmServer) -> None:
    async with crm_session(crm.url, crm.token) as session:
        tools = {tool.name: tool for tool in (await session.list_tools()).tools}

    assert set(tools) == {"get_customer", "create_ticket"}
    lookup_schema = tools["get_customer"].input_schema
    assert lookup_schema["required"] == ["customerId"]
    assert lookup_schema["properties"]["customerId"]["type"] == "string"

    ticket_schema = tools["create_ticket"].input_schema
    assert sorted(ticket_schema["required"]) == ["customerId", "priority", "subject"]
    assert ticket_schema["properties"]["priority"]["enum"] == ["low", "normal", "high", "urgent"]
    for tool in tools.values():
        assert tool.description and len(tool.description) > 80, "the model needs a real description"
    assert tools["get_customer"].annotations.read_only_hint is True
    assert tools["create_ticket"].annotations.read_only_hint is False


async def test_get_customer_c42_is_alice_a_gold_customer_with_a_lost_parcel(crm: RunningCrmServer) -> None:
    async with crm_session(crm.url, crm.token) as session:
        alice = result_json(await call_tool(session, "get_customer", {"customerId": "C-42"}))

    assert alice["name"] == "Alice Martin"
    assert alice["tier"] == "gold"
    assert alice["email"] == "alice.martin@example.com"
    order = next(order for order in alice["recentOrders"] if order["orderId"] == "5531")
    assert order["shipmentStatus"] == "lost_in_transit"


async def test_other_seeded_customers_are_found(crm: RunningCrmServer) -> None:
    async with crm_session(crm.url, crm.token) as session:
        bob = result_json(await call_tool(session, "get_customer", {"customerId": "C-7"}))
        chiara = result_json(await call_tool(session, "get_customer", {"customerId": "C-108"}))

    assert (bob["name"], bob["tier"]) == ("Bob Okafor", "silver")
    assert chiara["tier"] == "bronze"


async def test_unknown_customer_is_a_tool_error_and_the_session_keeps_working(crm: RunningCrmServer) -> None:
    async with crm_session(crm.url, crm.token) as session:
        missing = await call_tool(session, "get_customer", {"customerId": "C-999"})
        after = await call_tool(session, "get_customer", {"customerId": "C-42"})

    assert missing.is_error is True
    assert "No customer with id 'C-999'" in result_text(missing)
    assert after.is_error is False


async def test_create_ticket_on_a_fresh_store_is_t981_and_open() -> None:
    with running_crm_server() as fresh:
        async with crm_session(fresh.url, fresh.token) as session:
            first = result_json(
                await call_tool(
                    session,
                    "create_ticket",
                    {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"},
                )
            )
            second = result_json(
                await call_tool(
                    session,
                    "create_ticket",
                    {"customerId": "C-7", "subject": "Invoice copy", "priority": "low"},
                )
            )
        stored = fresh.tickets()

    assert {key: first[key] for key in ("ticketId", "customerId", "subject", "priority", "status")} == {
        "ticketId": "T-981",
        "customerId": "C-42",
        "subject": "Parcel not received",
        "priority": "high",
        "status": "open",
    }
    assert second["ticketId"] == "T-982"
    assert [ticket["ticketId"] for ticket in stored] == ["T-981", "T-982"]
    assert all(ticket["idempotencyKey"] is None for ticket in stored)


@pytest.mark.parametrize(
    ("arguments", "expected_message"),
    [
        ({"customerId": "C-42", "subject": "Parcel", "priority": "asap"}, "priority"),
        ({"customerId": "C-999", "subject": "Parcel", "priority": "high"}, "No customer with id 'C-999'"),
        ({"customerId": "C-42", "subject": "", "priority": "high"}, "subject"),
        ({"customerId": "C-42", "subject": "   ", "priority": "high"}, "subject must not be blank"),
    ],
)
async def test_create_ticket_refuses_bad_arguments_without_creating_anything(
    crm: RunningCrmServer, arguments: dict[str, str], expected_message: str
) -> None:
    before = len(crm.tickets())
    async with crm_session(crm.url, crm.token) as session:
        result = await call_tool(session, "create_ticket", arguments)

    assert result.is_error is True
    assert expected_message in result_text(result)
    assert len(crm.tickets()) == before
