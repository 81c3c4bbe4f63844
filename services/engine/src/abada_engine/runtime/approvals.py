"""Approvals: a tool call under `approval: required` waits for a person before it runs.

The worker journals the proposed call AWAITING_APPROVAL and hands the task back (`park`): the task
loses its lease (so the broker can issue no credential for it) and is not fetchable, and one
approval is opened per call. A person decides each (`decide`): approved, the step becomes
APPROVED with the arguments as approved (edited or not) and the journal will only accept that very
call; rejected, the step is COMPLETED with a tool error the model reads. Once every approval of the
task is decided the task is offered again, and the worker replays its journal: no model turn is
paid twice. Past the node's `approval_timeout` (`expire_overdue`, run by the reaper) the token
takes `on_approval_timeout`, or an APPROVAL_TIMEOUT incident holds the task.
"""

from __future__ import annotations

import builtins  # builtins.list: annotations after the class's own `list` method, which shadows it
import uuid
from collections import defaultdict
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.schemas import input_problem
from abada_engine.errors import invalid, not_found, precondition
from abada_engine.runtime.calls import follow_calls
from abada_engine.runtime.crypto.sealing import Place, StepSealer
from abada_engine.runtime.flow.navigator import HistoryEntry, IncidentToRaise, advance
from abada_engine.runtime.flow.tokens import advance_move, apply_move, history_record, write_history
from abada_engine.runtime.held import hold_for_a_person
from abada_engine.runtime.incident_types import APPROVAL_TIMEOUT
from abada_engine.runtime.leases import hold_lease
from abada_engine.runtime.offload import run_cpu_check
from abada_engine.store import approvals as approval_store
from abada_engine.store import instances as instance_store
from abada_engine.store import journal_steps as step_store
from abada_engine.store import tasks as task_store
from abada_engine.store.approvals import ApprovalListing, ApprovalRow, ListedApproval
from abada_engine.store.incidents import IncidentRow
from abada_engine.store.states import ApprovalState, InstanceState, StepState, TaskState

MAX_COMMENT_CHARS = 4_000
# How much of an edited call's check runs inline before it moves to the bounded executor.
_EDIT_CHECK_INLINE_STEPS = 2_000
DECISIONS = ("APPROVE", "REJECT")


@dataclass(frozen=True)
class ApprovalView:
    id: uuid.UUID
    state: str
    instance_id: uuid.UUID
    process_id: str
    business_key: str
    node_id: str
    task_id: uuid.UUID
    sequence: int
    tool_ref: str
    arguments: dict[str, Any]
    model_text: str
    created_at: datetime
    expires_at: datetime | None
    decided_by: str
    decided_at: datetime | None
    comment: str
    approved_arguments: dict[str, Any] | None
    # The tool's input schema as frozen at deploy: set by `get` only, when the version kept it.
    input_schema: dict[str, Any] | None = None


def rejection_result(reason: str) -> dict[str, Any]:
    """What the model reads for a rejected call: a tool error (MCP CallToolResult shape) with the reason."""
    return {"content": [{"type": "text", "text": f"rejected by a person: {reason}"}], "isError": True}


def approved_call(request: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """The call a person approved, as the journal will accept it: this call id, this function, these
    arguments (its keyed digest is what an approval keeps)."""
    return {"callId": request.get("callId", ""), "name": request.get("name", ""), "arguments": arguments}


def approved_arguments(response: dict[str, Any] | None) -> dict[str, Any] | None:
    """The arguments as approved, from the response an approval journaled on its step."""
    return ((response or {}).get("approval") or {}).get("arguments")


def _step_place(row: ListedApproval) -> Place:
    return Place(
        row.task_id,
        row.sequence,
        row.step_attempt,
        row.step_kind,
        row.step_tool_ref,
        row.step_key_id,
        row.step_aad_version,
    )


class Approvals:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog, sealer: StepSealer) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._sealer = sealer

    async def park(self, task_id: uuid.UUID, worker_id: str, lease_token: str) -> list[uuid.UUID]:
        """The lease holder hands the task back to wait for approvals; returns the pending approvals."""
        async with self._engine.begin() as conn:
            held = await hold_lease(conn, task_id, worker_id, lease_token)
            if await step_store.awaiting_approval_count(conn, task_id) == 0:
                raise precondition(
                    ErrorReason.NOTHING_TO_APPROVE,
                    f"task {task_id} has no tool call awaiting approval: journal one AWAITING_APPROVAL first",
                    "task_id",
                )
            definition = await self._catalog.get(held.definition_id)
            node = definition.process.node(held.node_id)
            await approval_store.open_for_awaiting_steps(
                conn, task_id, held.instance_id, node.id, node.approval_timeout_seconds
            )
            await task_store.park_for_approval(conn, task_id)
            pending = await approval_store.listed_of_task(conn, task_id, ApprovalState.PENDING)
            await write_history(
                conn,
                [
                    history_record(
                        held.instance_id,
                        HistoryEntry(
                            "APPROVAL_REQUESTED",
                            node.id,
                            {
                                "approval_id": str(a.id),
                                "tool_ref": a.tool_ref,
                                "sequence": a.sequence,
                                "attempt": held.attempt,
                                "worker_id": worker_id,
                            },
                        ),
                        task_id,
                    )
                    for a in pending
                ],
            )
        return [a.id for a in pending]

    async def list(
        self,
        which: ApprovalListing,
        limit: int = 1000,
        after_key: tuple[datetime, uuid.UUID, int] | None = None,
    ) -> list[ApprovalView]:
        async with self._reads.connect() as conn:
            rows = await approval_store.listed(conn, which, limit=limit, after_key=after_key)
        return [self._view(r) for r in rows]

    async def get(self, approval_id: uuid.UUID) -> ApprovalView:
        async with self._reads.connect() as conn:
            rows = await approval_store.listed(conn, approval_id=approval_id)
        if not rows:
            raise not_found("approval", str(approval_id), "approval_id")
        view = self._view(rows[0])
        definition = await self._catalog.get(rows[0].definition_id)
        binding = next((b for b in definition.tool_bindings if b.ref == view.tool_ref), None)
        if binding is None or binding.input_schema is None:
            return view
        return replace(view, input_schema=binding.input_schema)

    async def _check_edited(self, approval_id: uuid.UUID, arguments: dict[str, Any]) -> None:
        """Edited arguments meet the tool's input schema as deploy froze it, or nothing is decided
        (INVALID_ARGUMENT naming the argument): the call must be one the tool accepts, whoever edited
        it. The schema came from a tool server: it is checked like an output schema (RE2, no reference
        fetched, under a work budget, off the event loop when it could take long)."""
        schema = (await self.get(approval_id)).input_schema
        if schema is None:
            return  # deployed before tools' schemas were kept: the tool itself will judge
        problem = await run_cpu_check(True, _EDIT_CHECK_INLINE_STEPS, input_problem, schema, arguments)
        if problem is not None:
            name, why = problem
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                f"arguments.{name}" if name else "arguments",
                f"{why} (the tool's input schema, as deployed)",
            )

    async def decide(
        self,
        approval_id: uuid.UUID,
        decision: str,
        decided_by: str,
        comment: str = "",
        arguments: dict[str, Any] | None = None,
    ) -> ApprovalView:
        if decision not in DECISIONS:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "decision", "say APPROVE or REJECT")
        comment = comment.strip()
        if decision == "REJECT" and not comment:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "comment", "say why the call is rejected: the model reads it"
            )
        if decision == "REJECT" and arguments is not None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "arguments", "only an approval carries arguments")
        if len(comment) > MAX_COMMENT_CHARS:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "comment", f"is longer than {MAX_COMMENT_CHARS} characters"
            )
        if arguments is not None:
            await self._check_edited(approval_id, arguments)
        async with self._engine.begin() as conn:
            found = await approval_store.listed(conn, approval_id=approval_id)
            if not found:
                raise not_found("approval", str(approval_id), "approval_id")
            # Decisions on one task are serialised on its row, so exactly one of them sees the last
            # pending approval go and offers the task again.
            await task_store.lock_state(conn, found[0].task_id)
            row = await approval_store.lock(conn, approval_id)
            assert row is not None  # approvals are never deleted
            _check_decidable(row)
            request = self._request_of(row)
            if decision == "APPROVE":
                approved = request.get("arguments", {}) if arguments is None else arguments
                await self._approve(conn, row, request, approved, decided_by, comment)
            else:
                await self._reject(conn, row, decided_by, comment)
            await write_history(
                conn,
                [
                    history_record(
                        row.instance_id,
                        HistoryEntry(
                            "APPROVAL_DECIDED",
                            row.node_id,
                            {
                                "approval_id": str(row.id),
                                "tool_ref": row.tool_ref,
                                "sequence": row.sequence,
                                "decision": "APPROVED" if decision == "APPROVE" else "REJECTED",
                                "decided_by": decided_by,
                                "comment": comment,
                                "arguments_edited": arguments is not None
                                and arguments != request.get("arguments", {}),
                            },
                        ),
                        row.task_id,
                    )
                ],
            )
            if await approval_store.count_pending(conn, row.task_id) == 0:
                await task_store.offer_after_approval(conn, row.task_id)
        return await self.get(approval_id)

    async def _approve(
        self,
        conn: AsyncConnection,
        row: ListedApproval,
        request: dict[str, Any],
        approved: dict[str, Any],
        decided_by: str,
        comment: str,
    ) -> None:
        response = {
            "approval": {
                "id": str(row.id),
                "decision": "APPROVED",
                "arguments": approved,
                "decidedBy": decided_by,
                "comment": comment,
            }
        }
        sealed, digest = self._sealer.seal(_step_place(row), "response", response)
        assert sealed is not None and digest is not None
        await step_store.decide_awaiting(conn, row.task_id, row.sequence, StepState.APPROVED, sealed, digest)
        # The call the journal will accept: this call id, this function, these arguments.
        key_id = self._sealer.primary_key_id
        approved_request = approved_call(request, approved)
        await approval_store.record_decision(
            conn,
            row.id,
            ApprovalState.APPROVED,
            decided_by,
            comment,
            key_id,
            self._sealer.digest(key_id, approved_request),
        )

    async def _reject(self, conn: AsyncConnection, row: ListedApproval, decided_by: str, reason: str) -> None:
        sealed, digest = self._sealer.seal(_step_place(row), "response", rejection_result(reason))
        assert sealed is not None and digest is not None
        await step_store.decide_awaiting(conn, row.task_id, row.sequence, StepState.COMPLETED, sealed, digest)
        await approval_store.record_decision(conn, row.id, ApprovalState.REJECTED, decided_by, reason)

    async def expire_overdue(self, limit: int = 100) -> int:
        """Pending approvals past the node's approval_timeout: route the token or raise an incident.

        Run periodically by every replica; SKIP LOCKED keeps them out of each other's way.
        """
        handled = 0
        async with self._engine.begin() as conn:
            overdue = await approval_store.lock_expired(conn, limit)
            by_task: dict[uuid.UUID, list[ApprovalRow]] = defaultdict(list)
            for row in overdue:
                by_task[row.task_id].append(row)
            for task_id, rows in by_task.items():
                # A decision takes the task's row first: skip a task being decided on (no deadlock);
                # if the decision leaves an approval pending, the next round sees it again.
                state = await task_store.lock_state(conn, task_id, skip_locked=True)
                if state is None:
                    continue
                await self._time_out(conn, task_id, state, rows)
                handled += 1
        return handled

    async def _time_out(
        self, conn: AsyncConnection, task_id: uuid.UUID, state: str, overdue: builtins.list[ApprovalRow]
    ) -> None:
        first = overdue[0]
        reason = "nobody decided within the node's approval_timeout"
        await approval_store.close_pending_of_task(conn, task_id, ApprovalState.EXPIRED, reason)
        instance = await instance_store.lock(conn, first.instance_id)
        if state != TaskState.AWAITING_APPROVAL or instance is None or instance.state != InstanceState.ACTIVE:
            return  # the task moved on meanwhile (cancelled, say): nothing left to route
        definition = await self._catalog.get(instance.definition_id)
        node = definition.process.node(first.node_id)
        tool_refs = [r.tool_ref for r in overdue]
        details = {
            "task_id": str(task_id),
            "approval_ids": [str(r.id) for r in overdue],
            "tool_refs": tool_refs,
            "approval_timeout_seconds": node.approval_timeout_seconds,
        }
        timed_out = HistoryEntry("APPROVAL_TIMED_OUT", node.id, details)
        if node.on_approval_timeout:
            moved = advance(
                definition.process,
                instance.variables,
                node.on_approval_timeout,
                context={"approval_timeout": details},
            )
            move = advance_move(
                instance_id=first.instance_id,
                advance=moved,
                variables=None,
                preceding=[timed_out],
                preceding_task_id=task_id,
                finished_task_id=task_id,
                finished_state=TaskState.CANCELED,
            )
            await apply_move(conn, move)
            await follow_calls(conn, self._catalog, [move])
            return
        message = (
            f"{', '.join(sorted(set(tool_refs)))} waited for approval longer than the node's "
            "approval_timeout and the node has no on_approval_timeout: retry to ask again, or cancel"
        )
        await hold_for_a_person(
            conn,
            first.instance_id,
            IncidentToRaise(node.id, APPROVAL_TIMEOUT, message, details, task_id),
            preceding=(history_record(first.instance_id, timed_out, task_id),),
        )

    async def ask_again(
        self, conn: AsyncConnection, incident: IncidentRow, comment: str, result: dict[str, Any] | None
    ) -> None:
        """RETRY on an APPROVAL_TIMEOUT incident: the expired approvals are pending again, with a fresh
        timeout, and the task waits for them (the incident service closes the incident)."""
        assert incident.task_id is not None  # an APPROVAL_TIMEOUT incident always names its task
        instance = await instance_store.lock(conn, incident.instance_id)
        assert instance is not None
        definition = await self._catalog.get(instance.definition_id)
        node = definition.process.node(incident.node_id)
        if not await task_store.park_again(conn, incident.task_id):
            raise precondition(
                ErrorReason.RESOLUTION_NOT_APPLICABLE,
                f"task {incident.task_id} is no longer held by this incident",
                "incident_id",
            )
        reopened = await approval_store.reopen_expired_of_task(
            conn, incident.task_id, node.approval_timeout_seconds
        )
        if not reopened:
            # Parked with nothing to wait for, the task would never be offered again (the transaction
            # rolls the parking back).
            raise precondition(
                ErrorReason.RESOLUTION_NOT_APPLICABLE,
                f"task {incident.task_id} has no expired approval to ask again",
                "incident_id",
            )

    def _request_of(self, row: ListedApproval) -> dict[str, Any]:
        return self._sealer.open_sealed(_step_place(row), "request", row.request_ciphertext) or {}

    def _view(self, row: ListedApproval) -> ApprovalView:
        request = self._request_of(row)
        approved: dict[str, Any] | None = None
        if row.state == ApprovalState.APPROVED:
            response = self._sealer.open_sealed(_step_place(row), "response", row.response_ciphertext)
            approved = approved_arguments(response)
        return ApprovalView(
            id=row.id,
            state=row.state,
            instance_id=row.instance_id,
            process_id=row.process_id,
            business_key=row.business_key,
            node_id=row.node_id,
            task_id=row.task_id,
            sequence=row.sequence,
            tool_ref=row.tool_ref,
            arguments=dict(request.get("arguments") or {}),
            model_text=str(request.get("modelText") or ""),
            created_at=row.created_at,
            expires_at=row.expires_at,
            decided_by=row.decided_by or "",
            decided_at=row.decided_at,
            comment=row.comment or "",
            approved_arguments=approved,
        )


def _check_decidable(row: ListedApproval) -> None:
    if row.instance_state != InstanceState.ACTIVE or row.state == ApprovalState.CANCELED:
        raise precondition(
            ErrorReason.INSTANCE_NOT_ACTIVE,
            f"instance {row.instance_id} is {row.instance_state.lower()}: approval {row.id} can no longer be decided",
            "approval_id",
        )
    if row.state == ApprovalState.EXPIRED:
        raise precondition(
            ErrorReason.APPROVAL_EXPIRED,
            f"approval {row.id} expired at {row.decided_at.isoformat() if row.decided_at else 'its timeout'}: "
            "nobody decided within the node's approval_timeout",
            "approval_id",
        )
    if row.state != ApprovalState.PENDING:
        when = row.decided_at.isoformat() if row.decided_at else "earlier"
        raise precondition(
            ErrorReason.APPROVAL_ALREADY_DECIDED,
            f"approval {row.id} was already {row.state.lower()} by {row.decided_by or 'someone'} at {when}",
            "approval_id",
            metadata={"state": row.state, "decided_by": row.decided_by or ""},
        )
