"""Process instances: creating, reading with their open incidents, locking, cancelling."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, exists, func, select, true, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import incidents, instances, tasks

from . import keyset
from .hand_written import typed
from .states import IncidentState, InstanceState, TaskKind, TaskState, is_

# How instances are listed: newest first, the id breaking ties.
_ORDER = (instances.c.created_at, instances.c.id)


@dataclass(slots=True)
class InstanceRow:
    id: uuid.UUID
    definition_id: uuid.UUID
    process_id: str
    version: int
    state: str
    variables: dict[str, Any]
    current_node_id: str | None
    business_key: str
    created_at: datetime
    ended_at: datetime | None


@dataclass(slots=True)
class ListedInstance(InstanceRow):
    open_incidents: int
    # The instance whose call activity started this one (migration 0014); None for a top-level one.
    parent_instance_id: uuid.UUID | None = None


@dataclass(frozen=True)
class InstanceListing:
    """Which instances a list shows: those matching every filter given ("" and None match any);
    `waiting_for` (TIMER or RECEIVE) keeps those waiting on one."""

    process_id: str = ""
    state: str = ""
    business_key: str = ""
    created_after: datetime | None = None
    created_before: datetime | None = None
    variables_holding: dict[str, Any] | None = None
    waiting_for: TaskKind | None = None
    parent_instance_id: uuid.UUID | None = None


def narrowed_to_state_and_key(
    condition: ColumnElement[bool], state: str, business_key: str
) -> ColumnElement[bool]:
    """`condition`, kept to the instances in `state` with `business_key` ("" matches any): what a list's
    filter and a batch's filter both ask. The state is inlined, so a generic plan still sees the partial
    index of active instances."""
    if state:
        condition = condition & is_(instances.c.state, InstanceState(state))
    if business_key:
        condition = condition & (instances.c.business_key == business_key)
    return condition


async def listed(
    conn: AsyncConnection,
    which: InstanceListing = InstanceListing(),
    *,
    instance_id: uuid.UUID | None = None,
    limit: int = 100,
    after_key: tuple[datetime, uuid.UUID] | None = None,
) -> list[ListedInstance]:
    """Instances, newest first (by `created_at`, then id), each with its count of open incidents; after
    `after_key`, the last row of the page before. Each filter has an index that yields its rows in this
    order (migration 0008): active ones from a partial index, one process's from (process_id, created_at,
    id), a business key's from its own; states are inlined so a generic plan still sees the partial index.
    A time range (`created_after` inclusive, `created_before` exclusive) bounds the same index's range.
    `variables_holding` (top-level names and the values they must equal) is a containment the GIN index
    on the variables answers; the planner may instead walk the time-ordered index and filter, when the
    value is common."""
    condition: ColumnElement[bool] = true()
    if instance_id is not None:
        condition = condition & (instances.c.id == instance_id)
    if which.process_id:
        condition = condition & (instances.c.process_id == which.process_id)
    condition = narrowed_to_state_and_key(condition, which.state, which.business_key)
    if which.parent_instance_id is not None:
        # From the partial index of called instances (migration 0014).
        condition = condition & (instances.c.parent_instance_id == which.parent_instance_id)
    if which.variables_holding:
        condition = condition & instances.c.variables.contains(which.variables_holding)
    if which.created_after is not None:
        condition = condition & (instances.c.created_at >= which.created_after)
    if which.created_before is not None:
        condition = condition & (instances.c.created_at < which.created_before)
    if which.waiting_for is not None:
        # From the partial index of open waits (migration 0010), one probe per instance looked at.
        condition = condition & exists().where(
            tasks.c.instance_id == instances.c.id,
            is_(tasks.c.kind, which.waiting_for),
            is_(tasks.c.state, TaskState.WAITING),
        )
    if after_key is not None:
        condition = condition & keyset.after(_ORDER, after_key, descending=True)
    open_incidents = (
        select(func.count())
        .where(incidents.c.instance_id == instances.c.id, is_(incidents.c.state, IncidentState.OPEN))
        .scalar_subquery()
    )
    query = (
        select(instances, open_incidents.label("open_incidents"))
        .where(condition)
        .order_by(*(column.desc() for column in _ORDER))
        .limit(limit)
    )
    return [typed(ListedInstance, row._mapping) for row in (await conn.execute(query)).all()]


async def lock(conn: AsyncConnection, instance_id: uuid.UUID) -> InstanceRow | None:
    row = (
        await conn.execute(select(instances).where(instances.c.id == instance_id).with_for_update())
    ).one_or_none()
    return typed(InstanceRow, row._mapping) if row is not None else None


async def mark_canceled(conn: AsyncConnection, instance_id: uuid.UUID) -> None:
    await conn.execute(
        update(instances)
        .where(instances.c.id == instance_id)
        .values(state=InstanceState.CANCELED, ended_at=func.now())
    )
