"""ApprovalService: thin translation onto approvals."""

from __future__ import annotations

import uuid
from dataclasses import asdict
from datetime import datetime

import grpc
from abada.engine.v1 import approval_pb2, approval_pb2_grpc

from abada_engine.paging import MAX_LISTED, PageTokens, listing
from abada_engine.runtime.approvals import Approvals, ApprovalView
from abada_engine.store.approvals import ApprovalListing
from abada_engine.store.states import ApprovalState

from .convert import chosen, from_struct, parse_uuid, timestamp, to_struct
from .guard import ServiceHandler, caller_identity

_STATES = {
    ApprovalState.PENDING: approval_pb2.APPROVAL_STATE_PENDING,
    ApprovalState.APPROVED: approval_pb2.APPROVAL_STATE_APPROVED,
    ApprovalState.REJECTED: approval_pb2.APPROVAL_STATE_REJECTED,
    ApprovalState.EXPIRED: approval_pb2.APPROVAL_STATE_EXPIRED,
    ApprovalState.CANCELED: approval_pb2.APPROVAL_STATE_CANCELED,
}
_STATE_NAMES = {value: name for name, value in _STATES.items()}
_DECISIONS = {
    approval_pb2.APPROVAL_DECISION_APPROVE: "APPROVE",
    approval_pb2.APPROVAL_DECISION_REJECT: "REJECT",
}


def approval_message(value: ApprovalView) -> approval_pb2.Approval:
    message = approval_pb2.Approval(
        id=str(value.id),
        state=_STATES[ApprovalState(value.state)],
        instance_id=str(value.instance_id),
        process_id=value.process_id,
        business_key=value.business_key,
        node_id=value.node_id,
        task_id=str(value.task_id),
        sequence=value.sequence,
        tool_ref=value.tool_ref,
        arguments=to_struct(value.arguments),
        model_text=value.model_text,
        create_time=timestamp(value.created_at),
        expire_time=timestamp(value.expires_at),
        decided_by=value.decided_by,
        decide_time=timestamp(value.decided_at),
        comment=value.comment,
    )
    if value.approved_arguments is not None:
        message.approved_arguments.CopyFrom(to_struct(value.approved_arguments))
    if value.input_schema is not None:
        message.input_schema.CopyFrom(to_struct(value.input_schema))
    return message


class ApprovalHandler(ServiceHandler, approval_pb2_grpc.ApprovalServiceServicer):
    _approvals: Approvals
    _pages: PageTokens

    async def ListApprovals(
        self, request: approval_pb2.ListApprovalsRequest, context: grpc.aio.ServicerContext
    ) -> approval_pb2.ListApprovalsResponse:
        which = ApprovalListing(
            process_id=request.process_id,
            business_key=request.business_key,
            tool_ref=request.tool_ref,
            state=_STATE_NAMES.get(request.state, ApprovalState.PENDING),
        )
        shown, next_token = await self._pages.read(
            request,
            listing("approvals", **asdict(which)),
            (datetime, uuid.UUID, int),
            lambda limit, after: self._approvals.list(which, limit=limit, after_key=after),
            lambda a: (a.created_at, a.task_id, a.sequence),
            default_size=MAX_LISTED,
            max_size=MAX_LISTED,
        )
        return approval_pb2.ListApprovalsResponse(
            approvals=[approval_message(a) for a in shown], next_page_token=next_token
        )

    async def GetApproval(
        self, request: approval_pb2.GetApprovalRequest, context: grpc.aio.ServicerContext
    ) -> approval_pb2.GetApprovalResponse:
        found = await self._approvals.get(parse_uuid(request.approval_id, "approval_id"))
        return approval_pb2.GetApprovalResponse(approval=approval_message(found))

    async def DecideApproval(
        self, request: approval_pb2.DecideApprovalRequest, context: grpc.aio.ServicerContext
    ) -> approval_pb2.DecideApprovalResponse:
        decision = chosen(
            _DECISIONS,
            request.decision,
            "decision",
            "say APPROVAL_DECISION_APPROVE or APPROVAL_DECISION_REJECT",
        )
        decided = await self._approvals.decide(
            parse_uuid(request.approval_id, "approval_id"),
            decision,
            caller_identity(unauthenticated="anonymous"),
            request.comment,
            from_struct(request.arguments) if request.HasField("arguments") else None,
        )
        return approval_pb2.DecideApprovalResponse(approval=approval_message(decided))
