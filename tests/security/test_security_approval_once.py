"""Finding 4: one approval authorised any number of runs.

After one APPROVE the same call was journaled STARTED/COMPLETED at sequences 3, 4 and 5, each with a
new idempotency key: three writes at a keyed server. An approval is now used up by the first run
of its call journaled after it.
"""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import approval_pb2 as ap
from approval_helpers import PROPOSED, WORKER, parked_with_proposed_calls
from engine_helpers import append, error_info, fetch

CREATE = "crm/create_ticket"
APPROVED_CALL = {"callId": "c0", "name": "crm__create_ticket", "arguments": PROPOSED}


async def _approve(engine, approval_id: str) -> None:
    await engine.approvals.DecideApproval(
        ap.DecideApprovalRequest(approval_id=approval_id, decision=ap.APPROVAL_DECISION_APPROVE, comment="ok")
    )


async def _run_once(engine, task, sequence: int, request: dict | None = None) -> None:
    request = request or APPROVED_CALL
    await append(
        engine, task, sequence, "TOOL_CALL", "STARTED", tool_ref=CREATE, request=request, worker_id=WORKER
    )
    await append(
        engine,
        task,
        sequence,
        "TOOL_CALL",
        "COMPLETED",
        tool_ref=CREATE,
        response={"content": [{"type": "text", "text": "T-1"}]},
        worker_id=WORKER,
    )


async def test_one_approval_runs_the_call_once(engine, crm_credentials):
    _, [approval_id] = await parked_with_proposed_calls(engine, crm_credentials.url, calls=1)
    await _approve(engine, approval_id)
    [task] = await fetch(engine, WORKER, "abada:agent")
    await _run_once(engine, task, 3)

    for _ in range(2):  # and again: nothing was journaled
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await append(
                engine,
                task,
                4,
                "TOOL_CALL",
                "STARTED",
                tool_ref=CREATE,
                request=APPROVED_CALL,
                worker_id=WORKER,
            )
        assert error_info(caught.value).reason == "APPROVAL_REQUIRED"


async def test_each_approval_of_a_turn_runs_its_own_call_once(engine, crm_credentials):
    _, approvals = await parked_with_proposed_calls(engine, crm_credentials.url, calls=2)
    for approval_id in approvals:
        await _approve(engine, approval_id)
    [task] = await fetch(engine, WORKER, "abada:agent")
    second = {**APPROVED_CALL, "callId": "c1"}
    await _run_once(engine, task, 4)
    await _run_once(engine, task, 5, second)
    for request in (APPROVED_CALL, second):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await append(
                engine, task, 6, "TOOL_CALL", "STARTED", tool_ref=CREATE, request=request, worker_id=WORKER
            )
        assert error_info(caught.value).reason == "APPROVAL_REQUIRED"
