"""Deploy checks the live MCP contract and freezes what it saw."""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest
from abada.engine.v1 import common_pb2, definition_pb2
from abada_engine.definitions.parser import parse_bundle
from abada_engine.definitions.tool_contracts import McpContractCheck, schema_sha256
from abada_engine.errors import EngineError
from crm_mcp.tools import CREATE_TICKET_DESCRIPTION, GET_CUSTOMER_DESCRIPTION
from engine_helpers import deploy, error_info, fetch, start

BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      get_customer:  {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: key{pin} }}
processes:
  - id: support_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Look up ${{customerId}} and open a ticket.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        next: done
      - {{ id: done, type: end }}
"""


def bundle(url: str, pin: str = "") -> str:
    return BUNDLE.format(url=url, pin=f", input_schema_sha256: {pin}" if pin else "")


async def _observed_create_ticket_hash(engine, crm) -> str:
    response = await deploy(engine, bundle(crm.url))
    [binding] = [b for b in response.definitions[0].tool_bindings if b.tool == "create_ticket"]
    return binding.input_schema_sha256


async def test_deploy_freezes_url_policies_credential_and_observed_schema_hashes(engine, crm_credentials):
    response = await deploy(engine, bundle(crm_credentials.url))
    [definition] = response.definitions
    bindings = {b.tool: b for b in definition.tool_bindings}
    assert set(bindings) == {"get_customer", "create_ticket"}
    write = bindings["create_ticket"]
    assert (write.server, write.url, write.transport, write.credential) == (
        "crm",
        crm_credentials.url,
        "streamable-http",
        "crm-token",
    )
    assert write.policy == common_pb2.TOOL_POLICY_WRITE and write.idempotency == common_pb2.IDEMPOTENCY_KEY
    assert bindings["get_customer"].policy == common_pb2.TOOL_POLICY_READ
    assert len(write.input_schema_sha256) == 64
    # The description the model will read is pinned too: the SHA-256 of the text the server offered.
    assert write.description_sha256 == hashlib.sha256(CREATE_TICKET_DESCRIPTION.encode()).hexdigest()
    assert bindings["get_customer"].description_sha256 == (
        hashlib.sha256(GET_CUSTOMER_DESCRIPTION.encode()).hexdigest()
    )
    # agent_work carries exactly the frozen bindings.
    await start(engine, "support_triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent")
    assert list(task.agent_work.tool_bindings) == list(definition.tool_bindings)


async def test_a_matching_pin_deploys(engine, crm_credentials):
    observed = await _observed_create_ticket_hash(engine, crm_credentials)
    pinned = await deploy(engine, bundle(crm_credentials.url, pin=observed))
    # The pin agrees with what the server offers, so what is frozen is unchanged: still version 1.
    assert pinned.definitions[0].version == 1
    assert {b.tool: b.input_schema_sha256 for b in pinned.definitions[0].tool_bindings}[
        "create_ticket"
    ] == observed


async def test_a_missing_tool_refuses_the_deploy_and_stores_nothing(engine, crm_credentials):
    crm_credentials.set_variant("no-create-ticket")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle(crm_credentials.url))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(caught.value)
    assert info.reason == "TOOL_CONTRACT_MISMATCH"
    assert (info.metadata["server"], info.metadata["tool"]) == ("crm", "create_ticket")
    assert "not offered" in caught.value.details()
    listed = await engine.definitions.ListDefinitions(definition_pb2.ListDefinitionsRequest())
    assert list(listed.definitions) == []


async def test_a_pinned_hash_mismatch_refuses_the_deploy_naming_both_hashes(engine, crm_credentials):
    observed = await _observed_create_ticket_hash(engine, crm_credentials)
    crm_credentials.set_variant("changed-schema")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle(crm_credentials.url, pin=observed))
    info = error_info(caught.value)
    assert info.reason == "TOOL_CONTRACT_MISMATCH"
    assert observed in caught.value.details()
    assert "changed" in caught.value.details()


async def test_frozen_bindings_stay_when_the_server_changes_later(engine, crm_credentials):
    first = await deploy(engine, bundle(crm_credentials.url))
    crm_credentials.set_variant("changed-schema")
    got = await engine.definitions.GetDefinition(
        definition_pb2.GetDefinitionRequest(definition_id=first.definitions[0].id)
    )
    assert list(got.definition.tool_bindings) == list(first.definitions[0].tool_bindings)
    # Deploying the same bundle now observes the new schema, so it is new content: version 2.
    second = await deploy(engine, bundle(crm_credentials.url))
    assert second.definitions[0].version == 2
    new_hash = {b.tool: b.input_schema_sha256 for b in second.definitions[0].tool_bindings}["create_ticket"]
    old_hash = {b.tool: b.input_schema_sha256 for b in first.definitions[0].tool_bindings}["create_ticket"]
    assert new_hash != old_hash


async def test_a_rewritten_description_is_new_content_at_the_next_deploy(engine, crm_credentials):
    first = await deploy(engine, bundle(crm_credentials.url))
    crm_credentials.set_variant("changed-description")
    second = await deploy(engine, bundle(crm_credentials.url))

    assert second.definitions[0].version == 2
    old, new = (
        {b.tool: b for b in response.definitions[0].tool_bindings}["create_ticket"]
        for response in (first, second)
    )
    assert old.input_schema_sha256 == new.input_schema_sha256
    assert old.description_sha256 != new.description_sha256


async def test_an_unreachable_server_is_refused_quickly(engine, deploy_credentials):
    deploy_credentials.write_text("crm-token: whatever\n")
    begun = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle("http://127.0.0.1:9/mcp"))
    assert time.monotonic() - begun < 5
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(caught.value).reason == "TOOL_SERVER_UNAVAILABLE"


async def test_a_wrong_credential_is_named_as_refused(engine, crm, deploy_credentials):
    deploy_credentials.write_text("crm-token: not-the-token\n")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle(crm.url))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(caught.value).reason == "TOOL_SERVER_UNAUTHORIZED"
    assert f"tool server 'crm' at {crm.url} answered 401 Unauthorized" in caught.value.details()
    assert "it refused the credential 'crm-token'" in caught.value.details()


async def test_a_missing_credential_source_is_named_not_called_unreachable(crm):
    # An engine started without ABADA_BROKER_ADDRESS or ABADA_DEPLOY_CREDENTIALS_FILE sends no token.
    check = McpContractCheck(None, timeout_seconds=5)
    with pytest.raises(EngineError) as caught:
        await check(parse_bundle(bundle(crm.url)), "ops")
    assert caught.value.reason_name == "TOOL_SERVER_UNAUTHORIZED"
    assert caught.value.field == "tool_servers.crm.credential"
    assert "no credential source to read 'crm-token' from" in caught.value.message
    assert (
        "ABADA_BROKER_ADDRESS" in caught.value.message
        and "ABADA_DEPLOY_CREDENTIALS_FILE" in caught.value.message
    )


def test_schema_hash_is_the_sha256_of_canonical_json():
    import hashlib

    schema = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    expected = hashlib.sha256(
        b'{"properties":{"a":{"type":"integer"},"b":{"type":"string"}},"type":"object"}'
    ).hexdigest()
    assert schema_sha256(schema) == expected
