"""A request whose enum field names no value the call accepts (left unset, or a number no version of
the protos gave it) is refused before anything is looked up, naming the field and what it takes."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    batch_pb2,
    batch_pb2_grpc,
    external_task_pb2,
    incident_pb2,
    incident_pb2_grpc,
)
from engine_helpers import error_info

UNKNOWN = 99


def _calls(engine: Any, value: int) -> dict[str, tuple[Callable[[], Awaitable[Any]], str, str]]:
    """Each call with its enum field set to `value`: (the call, the field, what the refusal says)."""
    some_id = str(uuid.uuid4())
    approvals = approval_pb2_grpc.ApprovalServiceStub(engine.channel)
    incidents = incident_pb2_grpc.IncidentServiceStub(engine.channel)
    batches = batch_pb2_grpc.BatchServiceStub(engine.channel)
    return {
        "decide approval": (
            lambda: approvals.DecideApproval(
                approval_pb2.DecideApprovalRequest(approval_id=some_id, decision=value)  # type: ignore[arg-type]
            ),
            "decision",
            "APPROVAL_DECISION_APPROVE or APPROVAL_DECISION_REJECT",
        ),
        "resolve incident": (
            lambda: incidents.ResolveIncident(
                incident_pb2.ResolveIncidentRequest(incident_id=some_id, resolution=value)  # type: ignore[arg-type]
            ),
            "resolution",
            "RETRY, HAPPENED, DID_NOT_HAPPEN or CANCEL_INSTANCE",
        ),
        "create batch": (
            lambda: batches.CreateBatch(
                batch_pb2.CreateBatchRequest(kind=value, filter=batch_pb2.BatchFilter(process_id="p"))  # type: ignore[arg-type]
            ),
            "kind",
            "RETRY_INCIDENTS, CANCEL, MIGRATE or MODIFY",
        ),
        "append step kind": (
            lambda: engine.tasks.AppendStep(
                external_task_pb2.AppendStepRequest(
                    task_id=some_id,
                    worker_id="w",
                    lease_token="t",
                    attempt=1,
                    sequence=1,
                    kind=value,  # type: ignore[arg-type]
                    state=external_task_pb2.STEP_STATE_STARTED,
                )
            ),
            "kind",
            "STEP_KIND_MODEL_CALL or STEP_KIND_TOOL_CALL",
        ),
        "append step state": (
            lambda: engine.tasks.AppendStep(
                external_task_pb2.AppendStepRequest(
                    task_id=some_id,
                    worker_id="w",
                    lease_token="t",
                    attempt=1,
                    sequence=1,
                    kind=external_task_pb2.STEP_KIND_MODEL_CALL,
                    state=value,  # type: ignore[arg-type]
                )
            ),
            "state",
            "STARTED, COMPLETED, FAILED or AWAITING_APPROVAL",
        ),
    }


@pytest.mark.parametrize("value", [0, UNKNOWN], ids=["unset", "unknown"])
async def test_an_enum_field_naming_nothing_the_call_takes_is_refused_naming_it(engine, value: int) -> None:
    for name, (call, field, expected) in _calls(engine, value).items():
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        info = error_info(refused.value)
        assert (info.reason, info.metadata["field"]) == ("INVALID_ARGUMENT", field), name
        assert expected in (refused.value.details() or ""), name
