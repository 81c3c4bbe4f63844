"""Sealed values at rest, for `abada-engine reseal`: which are not under the primary key and the
current associated data, counted and read in batches, and written back only if unchanged meanwhile.

Sealed at rest are the journal steps' payloads (with their keyed digests) and the keyed digest of
the call a person approved (`approvals.approved_request_digest`); nothing else the engine stores is
sealed or keyed by a journal key.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import approvals, journal_steps

from .hand_written import typed
from .journal_steps import StepRow
from .states import ApprovalState


def _stale_step(primary: str, version: int):  # type: ignore[no-untyped-def]
    return or_(journal_steps.c.key_id != primary, journal_steps.c.aad_version != version)


async def steps_by_key(conn: AsyncConnection) -> dict[tuple[str, int], int]:
    """How many journal steps are sealed under each (key id, associated data version)."""
    rows = await conn.execute(
        select(journal_steps.c.key_id, journal_steps.c.aad_version, func.count().label("n")).group_by(
            journal_steps.c.key_id, journal_steps.c.aad_version
        )
    )
    return {(r.key_id, r.aad_version): r.n for r in rows.all()}


async def approvals_by_key(conn: AsyncConnection) -> dict[str, int]:
    """How many approved calls keep a digest under each key id."""
    rows = await conn.execute(
        select(approvals.c.key_id, func.count().label("n"))
        .where(approvals.c.key_id.is_not(None))
        .group_by(approvals.c.key_id)
    )
    return {r.key_id: r.n for r in rows.all()}


async def newest_step_key(conn: AsyncConnection) -> str | None:
    """The key id of the most recently written step: the one the engines seal under now."""
    return (
        await conn.execute(
            select(journal_steps.c.key_id).order_by(journal_steps.c.created_at.desc()).limit(1)
        )
    ).scalar_one_or_none()


async def stale_steps(
    conn: AsyncConnection, primary: str, version: int, after: tuple[uuid.UUID, int] | None, limit: int
) -> list[StepRow]:
    """The next `limit` steps, in key order after `after`, not sealed under `primary` and `version`."""
    query = select(journal_steps).where(_stale_step(primary, version))
    if after is not None:
        query = query.where(tuple_(journal_steps.c.task_id, journal_steps.c.sequence) > tuple_(*after))
    rows = await conn.execute(query.order_by(journal_steps.c.task_id, journal_steps.c.sequence).limit(limit))
    return [typed(StepRow, r._mapping) for r in rows.all()]


@dataclass(slots=True)
class Resealed:
    """A step's payloads and digests sealed again, to replace `row`'s."""

    row: StepRow
    key_id: str
    aad_version: int
    request_ciphertext: bytes | None
    response_ciphertext: bytes | None
    request_digest: bytes | None
    response_digest: bytes | None


async def replace_step_seal(conn: AsyncConnection, resealed: Resealed) -> bool:
    """Write the step sealed again, only if the row still holds exactly what was read (a running
    engine may have finished the step meanwhile); False if it did not."""
    row = resealed.row
    result = await conn.execute(
        update(journal_steps)
        .where(
            journal_steps.c.task_id == row.task_id,
            journal_steps.c.sequence == row.sequence,
            journal_steps.c.key_id == row.key_id,
            journal_steps.c.aad_version == row.aad_version,
            journal_steps.c.request_ciphertext.is_not_distinct_from(row.request_ciphertext),
            journal_steps.c.response_ciphertext.is_not_distinct_from(row.response_ciphertext),
        )
        .values(
            key_id=resealed.key_id,
            aad_version=resealed.aad_version,
            request_ciphertext=resealed.request_ciphertext,
            response_ciphertext=resealed.response_ciphertext,
            request_digest=resealed.request_digest,
            response_digest=resealed.response_digest,
        )
    )
    return result.rowcount == 1


@dataclass(slots=True)
class KeyedApproval:
    """An approved call's digest under a key other than the primary, with the step it approved."""

    approval_id: uuid.UUID
    approval_key_id: str
    approved_request_digest: bytes
    step: StepRow


async def stale_approvals(
    conn: AsyncConnection, primary: str, after: uuid.UUID | None, limit: int
) -> list[KeyedApproval]:
    """The next `limit` approved calls, by id after `after`, whose digest is not under `primary`."""
    query = (
        select(
            approvals.c.id.label("approval_id"),
            approvals.c.key_id.label("approval_key_id"),
            approvals.c.approved_request_digest,
            journal_steps,
        )
        .join(
            journal_steps,
            and_(
                journal_steps.c.task_id == approvals.c.task_id,
                journal_steps.c.sequence == approvals.c.sequence,
            ),
        )
        .where(
            approvals.c.state == ApprovalState.APPROVED,
            approvals.c.key_id.is_not(None),
            approvals.c.key_id != primary,
        )
    )
    if after is not None:
        query = query.where(approvals.c.id > after)
    rows = await conn.execute(query.order_by(approvals.c.id).limit(limit))
    return [
        KeyedApproval(
            r.approval_id, r.approval_key_id, bytes(r.approved_request_digest), typed(StepRow, r._mapping)
        )
        for r in rows.all()
    ]


async def replace_approval_digest(
    conn: AsyncConnection, approval: KeyedApproval, key_id: str, digest: bytes
) -> bool:
    """Keep the approved call's digest under `key_id`, only if the approval is as it was read."""
    result = await conn.execute(
        update(approvals)
        .where(
            approvals.c.id == approval.approval_id,
            approvals.c.key_id == approval.approval_key_id,
            approvals.c.approved_request_digest == approval.approved_request_digest,
        )
        .values(key_id=key_id, approved_request_digest=digest)
    )
    return result.rowcount == 1
