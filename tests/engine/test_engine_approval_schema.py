"""An approval carries its tool's input schema as deploy froze it, for the person editing the call."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import approval_pb2 as ap
from engine_helpers import deploy, error_info, plain
from test_engine_approvals import BUNDLE, PROPOSED, decide, park, proposing_task


async def test_get_approval_returns_the_tool_input_schema_frozen_at_deploy(engine, crm_credentials) -> None:  # type: ignore[no-untyped-def]
    _, task = await proposing_task(engine, crm_credentials)
    [approval_id] = await park(engine, task)

    found = (await engine.approvals.GetApproval(ap.GetApprovalRequest(approval_id=approval_id))).approval
    schema = plain(found.input_schema)
    assert set(schema["required"]) == {"customerId", "subject", "priority"}
    assert "high" in schema["properties"]["priority"]["enum"]
    assert schema["properties"]["customerId"]["maxLength"] == 64
    # Lists stay light: the schema comes with one approval only.
    [listed] = (await engine.approvals.ListApprovals(ap.ListApprovalsRequest())).approvals
    assert listed.id == approval_id and not listed.HasField("input_schema")

    # The schema is pinned by its sha256 already: keeping it changes no version's digest, so the
    # same bundle deployed again is the same version.
    again = await deploy(engine, BUNDLE.format(url=crm_credentials.url, timeout=""))
    assert list(again.created_process_ids) == []


async def test_an_edit_the_tools_schema_refuses_is_refused_naming_the_argument(
    engine, crm_credentials
) -> None:  # type: ignore[no-untyped-def]
    _, task = await proposing_task(engine, crm_credentials)
    [approval_id] = await park(engine, task)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await decide(engine, approval_id, "APPROVE", "", {**PROPOSED, "priority": "whenever"})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(refused.value).metadata["field"] == "arguments.priority"
    assert "the tool's input schema" in refused.value.details()
    # Nothing was decided: the call still waits, and a valid edit is taken.
    found = (await engine.approvals.GetApproval(ap.GetApprovalRequest(approval_id=approval_id))).approval
    assert found.state == ap.APPROVAL_STATE_PENDING
    decided = await decide(engine, approval_id, "APPROVE", "", {**PROPOSED, "priority": "urgent"})
    assert decided.state == ap.APPROVAL_STATE_APPROVED
