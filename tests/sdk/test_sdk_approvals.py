"""The SDK's list_approvals / approve / reject (async and sync) as an approver, against the real engine."""

from __future__ import annotations

import asyncio

import pytest
from abada_sdk import ApprovalState, AsyncEngineClient, EngineClient, FailedPrecondition, PermissionDenied
from approval_helpers import PROPOSED, parked_with_proposed_calls


async def test_an_approver_lists_approves_with_edits_and_rejects(
    engine, engine_tokens, crm, deploy_credentials
):
    deploy_credentials.write_text(f"crm-token: {crm.token}\n")
    instance_id, (first, second) = await parked_with_proposed_calls(engine, crm.url)

    async with AsyncEngineClient(engine.address, token=engine_tokens.approver, timeout=10) as carol:
        pending = await carol.list_approvals(business_key="C-42/parcel", tool_ref="crm/create_ticket")
        assert [a.id for a in pending] == [first, second]
        assert pending[0].state is ApprovalState.PENDING
        assert (pending[0].arguments, pending[0].model_text) == (PROPOSED, "Opening a ticket.")
        assert (pending[0].instance_id, pending[0].process_id, pending[0].node_id) == (
            instance_id,
            "guarded_triage",
            "triage",
        )
        assert pending[0].created_at is not None and pending[0].expires_at is None

        edited = {**PROPOSED, "priority": "urgent"}
        approved = await carol.approve(first, arguments=edited, comment="gold customer")
        assert approved.state is ApprovalState.APPROVED
        assert (approved.decided_by, approved.comment, approved.approved_arguments) == (
            "carol",
            "gold customer",
            edited,
        )
        with pytest.raises(FailedPrecondition) as twice:
            await carol.reject(first, "too late")
        assert twice.value.reason == "APPROVAL_ALREADY_DECIDED"
        # An approver decides approvals and nothing else.
        with pytest.raises(PermissionDenied):
            await carol.list_instances()

    def sync_side() -> tuple[list, object]:
        with EngineClient(engine.address, token=engine_tokens.approver, timeout=10) as client:
            rejected = client.reject(second, "one ticket is enough")
            return client.list_approvals(state=ApprovalState.REJECTED), rejected

    listed, rejected = await asyncio.to_thread(sync_side)
    assert [a.id for a in listed] == [second]
    assert rejected.state is ApprovalState.REJECTED and rejected.comment == "one ticket is enough"
