"""An approval carries its tool's input schema as deploy froze it, for the person editing the call."""

from __future__ import annotations

from abada.engine.v1 import approval_pb2 as ap
from engine_helpers import deploy, plain
from test_engine_approvals import BUNDLE, park, proposing_task


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
