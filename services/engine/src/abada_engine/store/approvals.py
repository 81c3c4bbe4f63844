"""Approvals: opening one per tool call awaiting a person, deciding, expiring, cancelling, reading.

The proposed arguments are not copied here: they stay sealed in the call's journal step, which the
readers join (`ListedApproval` carries the step's sealed payloads for the runtime to open).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnClause,
    DateTime,
    Float,
    Select,
    Text,
    Uuid,
    and_,
    bindparam,
    cast,
    func,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import approvals, instances, journal_steps

from . import keyset
from .hand_written import Executor, HandWritten, typed
from .states import ApprovalState, StepKind, StepState, is_

_SECOND: ColumnClause[Any] = literal_column("interval '1 second'")


@dataclass(slots=True)
class ApprovalRow:
    id: uuid.UUID
    task_id: uuid.UUID
    sequence: int
    instance_id: uuid.UUID
    node_id: str
    tool_ref: str
    state: str
    created_at: datetime
    expires_at: datetime | None
    decided_by: str | None
    decided_at: datetime | None
    comment: str | None
    key_id: str | None
    approved_request_digest: bytes | None


@dataclass(slots=True)
class ListedApproval(ApprovalRow):
    """An approval with its instance and its journal step (payloads still sealed)."""

    process_id: str
    business_key: str
    instance_state: str
    definition_id: uuid.UUID
    step_key_id: str
    step_aad_version: int
    step_kind: str
    step_tool_ref: str
    step_state: str
    step_attempt: int
    request_ciphertext: bytes | None
    response_ciphertext: bytes | None


def _listed_query() -> Select[*tuple[Any, ...]]:
    return (
        select(
            approvals,
            instances.c.process_id,
            instances.c.business_key,
            instances.c.state.label("instance_state"),
            instances.c.definition_id,
            journal_steps.c.key_id.label("step_key_id"),
            journal_steps.c.aad_version.label("step_aad_version"),
            journal_steps.c.kind.label("step_kind"),
            journal_steps.c.tool_ref.label("step_tool_ref"),
            journal_steps.c.state.label("step_state"),
            journal_steps.c.attempt.label("step_attempt"),
            journal_steps.c.request_ciphertext,
            journal_steps.c.response_ciphertext,
        )
        .join(instances, instances.c.id == approvals.c.instance_id)
        .join(
            journal_steps,
            and_(
                journal_steps.c.task_id == approvals.c.task_id,
                journal_steps.c.sequence == approvals.c.sequence,
            ),
        )
    )


async def open_for_awaiting_steps(
    conn: AsyncConnection,
    task_id: uuid.UUID,
    instance_id: uuid.UUID,
    node_id: str,
    expires_in_seconds: float | None,
) -> None:
    """One PENDING approval per tool call of the task awaiting approval that has none yet (a worker
    that died after journaling the call, and the next one handing the task back, open each once)."""
    expires = (
        func.now() + bindparam("expires_in", expires_in_seconds, Float) * _SECOND
        if expires_in_seconds is not None
        else cast(null(), DateTime(timezone=True))
    )
    awaiting = select(
        func.gen_random_uuid(),
        journal_steps.c.task_id,
        journal_steps.c.sequence,
        bindparam("instance_id", instance_id, Uuid),
        bindparam("node_id", node_id, Text),
        journal_steps.c.tool_ref,
        literal_column(f"'{ApprovalState.PENDING}'"),
        func.now(),
        expires,
    ).where(
        journal_steps.c.task_id == task_id,
        journal_steps.c.kind == StepKind.TOOL_CALL,
        is_(journal_steps.c.state, StepState.AWAITING_APPROVAL),
        ~journal_steps.c.abandoned,
    )
    statement = insert(approvals).from_select(
        [
            "id",
            "task_id",
            "sequence",
            "instance_id",
            "node_id",
            "tool_ref",
            "state",
            "created_at",
            "expires_at",
        ],
        awaiting,
    )
    await conn.execute(statement.on_conflict_do_nothing(index_elements=["task_id", "sequence"]))


async def lock(conn: AsyncConnection, approval_id: uuid.UUID) -> ListedApproval | None:
    """The approval with its instance and step, the approval and step rows locked for the caller's
    transaction (the decision seals the step's response as the step is sealed: nothing may seal the
    step again in between)."""
    row = (
        await conn.execute(
            _listed_query()
            .where(approvals.c.id == approval_id)
            .with_for_update(of=[approvals, journal_steps])
        )
    ).one_or_none()
    return typed(ListedApproval, row._mapping) if row is not None else None


async def record_decision(
    conn: AsyncConnection,
    approval_id: uuid.UUID,
    state: ApprovalState,
    decided_by: str,
    comment: str,
    key_id: str | None = None,
    approved_request_digest: bytes | None = None,
) -> None:
    await conn.execute(
        update(approvals)
        .where(approvals.c.id == approval_id)
        .values(
            state=state,
            decided_by=decided_by,
            decided_at=func.now(),
            comment=comment,
            key_id=key_id,
            approved_request_digest=approved_request_digest,
        )
    )


async def count_pending(conn: AsyncConnection, task_id: uuid.UUID) -> int:
    return (
        await conn.execute(
            select(func.count()).where(
                approvals.c.task_id == task_id, is_(approvals.c.state, ApprovalState.PENDING)
            )
        )
    ).scalar_one()


# Hand-written: the journal's careful path runs it, on whichever connection it holds (asyncpg's own
# pool or a SQLAlchemy connection), before a call under approval may start.
APPROVED_DIGESTS = HandWritten(
    f"""
    SELECT key_id, approved_request_digest FROM approvals
    WHERE task_id = CAST(:task_id AS uuid) AND state = '{ApprovalState.APPROVED}' AND key_id IS NOT NULL
    """
)


async def approved_digests(conn: Executor, task_id: uuid.UUID) -> list[tuple[str, bytes]]:
    """The (key id, request digest) of every call of the task a person approved."""
    rows = await APPROVED_DIGESTS.fetch(conn, {"task_id": str(task_id)})
    return [(r.key_id, bytes(r.approved_request_digest)) for r in rows]


# Every approval of the task, decided or not: where each was asked (its journal sequence) and, once
# approved, the digest of the call approved.
APPROVALS_OF_TASK = HandWritten(
    """
    SELECT sequence, state, key_id, approved_request_digest FROM approvals
    WHERE task_id = CAST(:task_id AS uuid) ORDER BY sequence
    """
)


@dataclass(frozen=True)
class AskedApproval:
    sequence: int
    state: str
    key_id: str | None
    approved_request_digest: bytes | None


async def approvals_of_task(conn: Executor, task_id: uuid.UUID) -> list[AskedApproval]:
    rows = await APPROVALS_OF_TASK.fetch(conn, {"task_id": str(task_id)})
    return [
        AskedApproval(
            r.sequence,
            r.state,
            r.key_id,
            bytes(r.approved_request_digest) if r.approved_request_digest is not None else None,
        )
        for r in rows
    ]


async def lock_expired(conn: AsyncConnection, limit: int) -> list[ApprovalRow]:
    """Pending approvals past their expiry, locked (SKIP LOCKED: replicas share the work)."""
    rows = await conn.execute(
        select(approvals)
        .where(is_(approvals.c.state, ApprovalState.PENDING), approvals.c.expires_at <= func.now())
        .order_by(approvals.c.expires_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [typed(ApprovalRow, r._mapping) for r in rows.all()]


async def close_pending_of_task(
    conn: AsyncConnection, task_id: uuid.UUID, state: ApprovalState, comment: str
) -> int:
    """Every still pending approval of the task ends in `state` (expired, cancelled); how many did."""
    result = await conn.execute(
        update(approvals)
        .where(approvals.c.task_id == task_id, is_(approvals.c.state, ApprovalState.PENDING))
        .values(state=state, decided_at=func.now(), comment=comment)
    )
    return result.rowcount


async def cancel_pending_of_instance(conn: AsyncConnection, instance_id: uuid.UUID, comment: str) -> None:
    await conn.execute(
        update(approvals)
        .where(approvals.c.instance_id == instance_id, is_(approvals.c.state, ApprovalState.PENDING))
        .values(state=ApprovalState.CANCELED, decided_at=func.now(), comment=comment)
    )


async def reopen_expired_of_task(
    conn: AsyncConnection, task_id: uuid.UUID, expires_in_seconds: float | None
) -> int:
    """Ask again: the task's expired approvals are pending once more, with a fresh expiry."""
    expires = (
        func.now() + bindparam("expires_in", expires_in_seconds, Float) * _SECOND
        if expires_in_seconds is not None
        else None
    )
    result = await conn.execute(
        update(approvals)
        .where(approvals.c.task_id == task_id, is_(approvals.c.state, ApprovalState.EXPIRED))
        .values(state=ApprovalState.PENDING, expires_at=expires, decided_at=None, comment=None)
    )
    return result.rowcount


@dataclass(frozen=True)
class ApprovalListing:
    """Which approvals a list shows: those matching every filter given ("" matches any)."""

    process_id: str = ""
    business_key: str = ""
    tool_ref: str = ""
    state: str = ""


async def listed(
    conn: AsyncConnection,
    which: ApprovalListing = ApprovalListing(),
    *,
    approval_id: uuid.UUID | None = None,
    limit: int = 1000,
    after_key: tuple[datetime, uuid.UUID, int] | None = None,
) -> list[ListedApproval]:
    """Approvals, oldest first (a task's calls in their order), after `after_key`, the last row of the
    page before: (created_at, task_id, sequence)."""
    order = (approvals.c.created_at, approvals.c.task_id, approvals.c.sequence)
    query = keyset.ordered(_listed_query(), order, after_key)
    if approval_id is not None:
        query = query.where(approvals.c.id == approval_id)
    if which.process_id:
        query = query.where(instances.c.process_id == which.process_id)
    if which.business_key:
        query = query.where(instances.c.business_key == which.business_key)
    if which.tool_ref:
        query = query.where(approvals.c.tool_ref == which.tool_ref)
    if which.state:
        query = query.where(approvals.c.state == which.state)
    rows = (await conn.execute(query.limit(limit))).all()
    return [typed(ListedApproval, row._mapping) for row in rows]


async def listed_of_task(conn: AsyncConnection, task_id: uuid.UUID, state: str) -> list[ListedApproval]:
    rows = (
        await conn.execute(
            _listed_query()
            .where(approvals.c.task_id == task_id, approvals.c.state == state)
            .order_by(approvals.c.sequence)
        )
    ).all()
    return [typed(ListedApproval, row._mapping) for row in rows]
