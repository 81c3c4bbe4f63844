"""Batches: creating one over the instances a filter matches, claiming its pending instances, recording
each outcome, and the batch's state transitions.

The job claims pending items with `FOR UPDATE SKIP LOCKED`: replicas running it side by side each take
other instances, and an item whose transaction was cut short (a restart) is pending again.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, exists, func, insert, literal, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import batch_items, batches, incidents, instances, tasks

from .hand_written import typed
from .instances import narrowed_to_state_and_key
from .states import (
    OPEN_TASK_STATES,
    BatchOutcome,
    BatchState,
    IncidentState,
    InstanceState,
    is_,
    one_of,
)


@dataclass(frozen=True, slots=True)
class BatchFilter:
    """Which instances a batch takes: every condition that is set must hold."""

    process_id: str
    version: int = 0
    state: str = InstanceState.ACTIVE
    node_id: str = ""
    business_key: str = ""
    incident_type: str = ""
    incident_message: str = ""

    def as_json(self) -> dict[str, Any]:
        # Every field under its own name, as `from_json` reads it back.
        return asdict(self)

    @staticmethod
    def from_json(value: dict[str, Any]) -> BatchFilter:
        return BatchFilter(
            process_id=str(value.get("process_id", "")),
            version=int(value.get("version", 0)),
            state=str(value.get("state", InstanceState.ACTIVE)),
            node_id=str(value.get("node_id", "")),
            business_key=str(value.get("business_key", "")),
            incident_type=str(value.get("incident_type", "")),
            incident_message=str(value.get("incident_message", "")),
        )


@dataclass(slots=True)
class BatchRow:
    id: uuid.UUID
    kind: str
    state: str
    filter: dict[str, Any]
    parameters: dict[str, Any]
    created_by: str
    created_at: datetime
    ended_at: datetime | None
    total: int
    done: int
    skipped: int
    failed: int


@dataclass(slots=True)
class BatchItemRow:
    instance_id: uuid.UUID
    outcome: str
    message: str
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class Claimed:
    batch_id: uuid.UUID
    instance_id: uuid.UUID
    kind: str
    filter: dict[str, Any]
    parameters: dict[str, Any]
    # Who created the batch: the changes it makes are theirs in each instance's history.
    created_by: str


def _incident_matches(which: BatchFilter) -> ColumnElement[bool]:
    condition: ColumnElement[bool] = is_(incidents.c.state, IncidentState.OPEN)
    if which.incident_type:
        condition = condition & (incidents.c.type == which.incident_type)
    if which.incident_message:
        condition = condition & incidents.c.message.contains(which.incident_message, autoescape=True)
    return condition


def _matching(which: BatchFilter) -> Any:
    condition: ColumnElement[bool] = instances.c.process_id == which.process_id
    if which.version:
        condition = condition & (instances.c.version == which.version)
    condition = narrowed_to_state_and_key(condition, which.state, which.business_key)
    if which.node_id:
        # Where the token rests, or, between a fork and its join, any branch's open task.
        condition = condition & (
            (instances.c.current_node_id == which.node_id)
            | exists().where(
                tasks.c.instance_id == instances.c.id,
                tasks.c.node_id == which.node_id,
                one_of(tasks.c.state, OPEN_TASK_STATES),
            )
        )
    if which.incident_type or which.incident_message:
        condition = condition & exists().where(
            incidents.c.instance_id == instances.c.id, _incident_matches(which)
        )
    return select(instances.c.id).where(condition)


async def create(
    conn: AsyncConnection,
    batch_id: uuid.UUID,
    kind: str,
    which: BatchFilter,
    parameters: dict[str, Any],
    created_by: str,
) -> int:
    """A RUNNING batch with one PENDING item per instance `which` matches now (COMPLETED at once when
    none does); answers how many."""
    await conn.execute(
        insert(batches).values(
            id=batch_id,
            kind=kind,
            state=BatchState.RUNNING,
            filter=which.as_json(),
            parameters=parameters,
            created_by=created_by,
            created_at=func.now(),
            total=0,
            done=0,
            skipped=0,
            failed=0,
        )
    )
    matched = _matching(which).add_columns(
        literal(batch_id).label("batch_id"), literal(str(BatchOutcome.PENDING)).label("outcome")
    )
    result = await conn.execute(
        insert(batch_items).from_select(["instance_id", "batch_id", "outcome"], matched)
    )
    total = int(result.rowcount)
    await conn.execute(
        update(batches)
        .where(batches.c.id == batch_id)
        .values(
            total=total,
            state=BatchState.RUNNING if total else BatchState.COMPLETED,
            ended_at=None if total else func.now(),
        )
    )
    return total


async def get(conn: AsyncConnection, batch_id: uuid.UUID) -> BatchRow | None:
    row = (await conn.execute(select(batches).where(batches.c.id == batch_id))).one_or_none()
    return typed(BatchRow, row._mapping) if row is not None else None


async def listed(conn: AsyncConnection, limit: int) -> list[BatchRow]:
    query = select(batches).order_by(batches.c.created_at.desc(), batches.c.id.desc()).limit(limit)
    return [typed(BatchRow, row._mapping) for row in (await conn.execute(query)).all()]


async def items(
    conn: AsyncConnection,
    batch_id: uuid.UUID,
    limit: int,
    after_instance_id: uuid.UUID | None = None,
    outcome: str = "",
) -> list[BatchItemRow]:
    condition: ColumnElement[bool] = batch_items.c.batch_id == batch_id
    if after_instance_id is not None:
        condition = condition & (batch_items.c.instance_id > after_instance_id)
    if outcome:
        condition = condition & (batch_items.c.outcome == outcome)
    query = select(batch_items).where(condition).order_by(batch_items.c.instance_id).limit(limit)
    return [typed(BatchItemRow, row._mapping) for row in (await conn.execute(query)).all()]


async def change_state(
    conn: AsyncConnection, batch_id: uuid.UUID, from_states: tuple[BatchState, ...], to: BatchState
) -> bool:
    """Move the batch to `to` if it is in one of `from_states` (ending it when `to` is CANCELED)."""
    values: dict[str, Any] = {"state": to}
    if to == BatchState.CANCELED:
        values["ended_at"] = func.now()
    result = await conn.execute(
        update(batches).where(batches.c.id == batch_id, one_of(batches.c.state, from_states)).values(**values)
    )
    return bool(result.rowcount)


async def claim(conn: AsyncConnection, limit: int) -> list[Claimed]:
    """Up to `limit` pending items of the oldest running batch that has some free, locked for this
    transaction; items another replica holds are passed over. The batch is chosen first, so the items
    come from the partial index of pending items in its order: a batch of a million instances costs
    each claim an index range, not a sort of everything pending."""
    running = (
        await conn.execute(
            select(batches.c.id, batches.c.kind, batches.c.filter, batches.c.parameters, batches.c.created_by)
            .where(is_(batches.c.state, BatchState.RUNNING))
            .order_by(batches.c.created_at, batches.c.id)
        )
    ).all()
    for batch in running:
        query = (
            select(batch_items.c.instance_id)
            .where(batch_items.c.batch_id == batch.id, is_(batch_items.c.outcome, BatchOutcome.PENDING))
            .order_by(batch_items.c.instance_id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        found = (await conn.execute(query)).scalars().all()
        if found:
            return [
                Claimed(batch.id, i, batch.kind, batch.filter, batch.parameters, batch.created_by)
                for i in found
            ]
    return []


async def record(
    conn: AsyncConnection, batch_id: uuid.UUID, instance_id: uuid.UUID, outcome: BatchOutcome, message: str
) -> None:
    await conn.execute(
        update(batch_items)
        .where(batch_items.c.batch_id == batch_id, batch_items.c.instance_id == instance_id)
        .values(outcome=outcome, message=message, finished_at=func.now())
    )


async def count(conn: AsyncConnection, batch_id: uuid.UUID, done: int, skipped: int, failed: int) -> None:
    """Add a chunk's outcomes to the batch's counters."""
    await conn.execute(
        update(batches)
        .where(batches.c.id == batch_id)
        .values(
            done=batches.c.done + done,
            skipped=batches.c.skipped + skipped,
            failed=batches.c.failed + failed,
        )
    )


async def complete_finished(conn: AsyncConnection) -> int:
    """Running batches with no pending item left become COMPLETED; answers how many."""
    pending = exists().where(
        batch_items.c.batch_id == batches.c.id, is_(batch_items.c.outcome, BatchOutcome.PENDING)
    )
    result = await conn.execute(
        update(batches)
        .where(is_(batches.c.state, BatchState.RUNNING), ~pending)
        .values(state=BatchState.COMPLETED, ended_at=func.now())
    )
    return int(result.rowcount)


async def open_incidents_of(
    conn: AsyncConnection, instance_id: uuid.UUID, which: BatchFilter
) -> list[uuid.UUID]:
    """The instance's open incidents a retry batch takes (of the filter's type and message), oldest first."""
    query = (
        select(incidents.c.id)
        .where(incidents.c.instance_id == instance_id, _incident_matches(which))
        .order_by(incidents.c.created_at)
    )
    return list((await conn.execute(query)).scalars().all())
