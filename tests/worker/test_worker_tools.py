"""The bound tools against the real demo CRM: credentials, the contract check, keyed writes."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from abada_sdk.connection import BearerToken
from abada_worker.broker_client import BrokerClient, Secret
from abada_worker.dependencies import DependencyDown, tool_server
from abada_worker.engine_client import LeaseRef
from abada_worker.tool_session import ToolServer, ToolServerRefused, description_sha256, schema_sha256
from abada_worker.toolbox import ContractBroken, Toolbox
from abada_worker.work import ToolBinding
from crm_mcp.testing import RunningCrmServer
from worker_servers import FakeBroker, running_broker, running_echo_mcp
from worker_support import CREATE_TICKET, GET_CUSTOMER, agent_work

LEASE = LeaseRef(task_id="task-7f3", lease_token="lease-token-1", attempt=1)
PARCEL = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}


@pytest.fixture(autouse=True)
def standard_contract(crm: RunningCrmServer) -> None:
    crm.set_variant("standard")


@dataclass(frozen=True)
class Broker:
    client: BrokerClient
    fake: FakeBroker


@pytest.fixture
async def broker(crm: RunningCrmServer) -> AsyncIterator[Broker]:
    async with (
        running_broker({"crm": crm.token}) as (fake, address),
        grpc.aio.insecure_channel(address) as channel,
    ):
        yield Broker(BrokerClient(channel, "worker-1", BearerToken("worker-1-token")), fake)


async def observed_hashes(crm: RunningCrmServer) -> dict[str, str]:
    async with ToolServer.connect("crm", crm.url, Secret(crm.token), timeout_seconds=10) as server:
        return {name: schema_sha256(tool.input_schema) for name, tool in (await server.list_tools()).items()}


def bound_to(crm: RunningCrmServer, hashes: dict[str, str] | None = None) -> tuple[ToolBinding, ToolBinding]:
    pins = hashes or {}
    return tuple(  # type: ignore[return-value]
        dataclasses.replace(binding, url=crm.url, input_schema_sha256=pins.get(binding.tool, ""))
        for binding in (GET_CUSTOMER, CREATE_TICKET)
    )


async def test_the_toolbox_offers_the_bound_tools_with_their_schemas_using_the_brokers_secret(
    crm: RunningCrmServer, broker: Broker
) -> None:
    work = agent_work(*bound_to(crm, await observed_hashes(crm)))

    async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10) as toolbox:
        functions = {spec.name: spec for spec in toolbox.functions}
        alice = await toolbox.call(work.bindings[0], {"customerId": "C-42"}, None)

    assert list(functions) == ["crm__get_customer", "crm__create_ticket"]
    assert functions["crm__create_ticket"].parameters["required"] == ["customerId", "subject", "priority"]
    assert "ticket" in functions["crm__create_ticket"].description
    assert alice["structuredContent"]["tier"] == "gold" and alice["isError"] is False
    (request,) = broker.fake.requests
    assert (request.task_id, request.worker_id, request.lease_token, request.server) == (
        "task-7f3",
        "worker-1",
        "lease-token-1",
        "crm",
    )
    assert broker.fake.authorizations == ["Bearer worker-1-token"]


async def test_a_withdrawn_tool_fails_the_contract(crm: RunningCrmServer, broker: Broker) -> None:
    work = agent_work(*bound_to(crm, await observed_hashes(crm)))
    crm.set_variant("no-create-ticket")

    with pytest.raises(ContractBroken) as broken:
        async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10):
            pytest.fail("the toolbox opened despite the missing tool")

    assert (broken.value.error_code, broken.value.no_retry) == ("TOOL_CONTRACT_MISMATCH", True)
    assert broken.value.details["mismatches"][0]["tool"] == "create_ticket"
    assert broken.value.details["mismatches"][0]["problem"] == "missing"


async def test_a_changed_input_schema_fails_the_contract(crm: RunningCrmServer, broker: Broker) -> None:
    pinned = await observed_hashes(crm)
    work = agent_work(*bound_to(crm, pinned))
    crm.set_variant("changed-schema")

    with pytest.raises(ContractBroken) as broken:
        async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10):
            pytest.fail("the toolbox opened despite the changed schema")

    (mismatch,) = broken.value.details["mismatches"]
    assert mismatch["tool"] == "create_ticket"
    assert mismatch["expected_sha256"] == pinned["create_ticket"]
    assert mismatch["observed_sha256"] == (await observed_hashes(crm))["create_ticket"]
    assert mismatch["observed_sha256"] != mismatch["expected_sha256"]


async def test_a_rewritten_description_fails_the_contract_before_the_model_reads_it(
    crm: RunningCrmServer, broker: Broker
) -> None:
    async with ToolServer.connect("crm", crm.url, Secret(crm.token), timeout_seconds=10) as server:
        pinned = {
            name: description_sha256(tool.description) for name, tool in (await server.list_tools()).items()
        }
    work = agent_work(
        *(
            dataclasses.replace(binding, description_sha256=pinned[binding.tool])
            for binding in bound_to(crm, await observed_hashes(crm))
        )
    )
    crm.set_variant("changed-description")

    with pytest.raises(ContractBroken) as broken:
        async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10):
            pytest.fail("the toolbox opened despite the rewritten description")

    (mismatch,) = broken.value.details["mismatches"]
    assert (mismatch["tool"], mismatch["problem"]) == ("create_ticket", "description changed")
    assert mismatch["expected_sha256"] == pinned["create_ticket"]
    assert mismatch["observed_sha256"] != pinned["create_ticket"]
    # The schema is the same, so only the description tells the change apart.
    assert (await observed_hashes(crm))["create_ticket"] == work.bindings[1].input_schema_sha256


async def test_a_keyed_write_sent_twice_in_two_sessions_creates_one_ticket(
    crm: RunningCrmServer, broker: Broker
) -> None:
    work = agent_work(*bound_to(crm))
    key = f"key-{uuid.uuid4()}"

    async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10) as toolbox:
        first = await toolbox.call(work.bindings[1], PARCEL, key)
    # As a successor worker would after a crash: a new session, the same key.
    async with Toolbox.open(work, LEASE, broker.client, timeout_seconds=10) as toolbox:
        again = await toolbox.call(work.bindings[1], PARCEL, key)

    assert again["structuredContent"]["ticketId"] == first["structuredContent"]["ticketId"]
    assert [t["ticketId"] for t in crm.tickets() if t["idempotencyKey"] == key] == [
        first["structuredContent"]["ticketId"]
    ]


async def test_the_key_travels_both_as_header_and_in_meta_and_only_for_that_call() -> None:
    async with running_echo_mcp() as url, ToolServer.connect("echo", url, None, timeout_seconds=10) as server:
        keyed = await server.call("echo_keys", {"note": "write"}, "key-42", timeout_seconds=10)
        unkeyed = await server.call("echo_keys", {"note": "read"}, None, timeout_seconds=10)

    assert keyed["structuredContent"] == {"header": "key-42", "meta": "key-42", "note": "write"}
    assert unkeyed["structuredContent"] == {"header": None, "meta": None, "note": "read"}


async def test_a_tool_error_is_a_result_for_the_model(crm: RunningCrmServer) -> None:
    async with ToolServer.connect("crm", crm.url, Secret(crm.token), timeout_seconds=10) as server:
        result = await server.call("get_customer", {"customerId": "C-999"}, None, timeout_seconds=10)

    assert result["isError"] is True
    assert "No customer with id 'C-999'" in result["content"][0]["text"]


async def test_a_refused_credential_is_a_refusal_and_an_absent_server_an_outage_not_a_model_matter(
    crm: RunningCrmServer,
) -> None:
    with pytest.raises(
        ToolServerRefused, match=r"tool server 'crm' .* rejected the credential \(401\)"
    ) as refused:
        async with ToolServer.connect("crm", crm.url, Secret("wrong-token"), timeout_seconds=10):
            pytest.fail("connected with a wrong token")
    assert refused.value.error_code == "TOOL_SERVER_REFUSED"
    assert refused.value.no_retry is True, "no wait fixes a rejected credential"
    with pytest.raises(ToolServerRefused, match="serves no MCP endpoint there"):
        async with ToolServer.connect(
            "crm", crm.base_url + "/elsewhere", Secret(crm.token), timeout_seconds=10
        ):
            pytest.fail("connected to a path with no MCP endpoint")
    with pytest.raises(DependencyDown) as unreachable:
        async with ToolServer.connect("crm", "http://127.0.0.1:9/mcp", Secret(crm.token), timeout_seconds=5):
            pytest.fail("connected to nothing")
    assert unreachable.value.dependency == tool_server("crm")
    assert "cannot talk to tool server 'crm'" in unreachable.value.message


async def test_a_result_too_big_for_the_journal_reaches_the_model_as_an_error(broker: Broker) -> None:
    async with running_echo_mcp() as url:
        echo = ToolBinding("echo", "echo_keys", False, False, url, "streamable-http", "", "")
        async with Toolbox.open(agent_work(echo), LEASE, broker.client, timeout_seconds=10) as toolbox:
            small = await toolbox.call(echo, {"note": "hello"}, None)
            huge = await toolbox.call(echo, {"note": "x" * 300_000}, None)

    assert small["structuredContent"]["note"] == "hello"
    assert huge["isError"] is True
    assert "echo_keys was called, but its result was" in huge["content"][0]["text"]
    assert broker.fake.requests == [], "a server without a credential needs none from the broker"
