"""Incidents: raising them, locking one for a resolution, closing them, and reading them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import incidents, instances
from abada_engine.ids import new_id

from . import keyset
from .hand_written import typed
from .states import IncidentState, is_

INSTANCE_CANCELED = "INSTANCE_CANCELED"  # the resolution recorded on incidents closed by a cancel
BRANCH_WITHDRAWN = "BRANCH_WITHDRAWN"  # ... and on those of branches a join on `any` withdrew


@dataclass(slots=True)
class IncidentRow:
    id: uuid.UUID
    instance_id: uuid.UUID
    task_id: uuid.UUID | None
    node_id: str
    type: str
    message: str
    details: dict[str, Any]
    state: str
    created_at: datetime
    resolved_at: datetime | None
    resolution: str | None


@dataclass(slots=True)
class ListedIncident(IncidentRow):
    process_id: str


async def raise_incident(
    conn: AsyncConnection,
    *,
    instance_id: uuid.UUID,
    node_id: str,
    type_: str,
    message: str,
    details: dict[str, Any] | None = None,
    task_id: uuid.UUID | None = None,
) -> uuid.UUID:
    incident_id = new_id()
    await conn.execute(
        insert(incidents).values(
            id=incident_id,
            instance_id=instance_id,
            task_id=task_id,
            node_id=node_id,
            type=type_,
            message=message,
            details=details or {},
            state=IncidentState.OPEN,
            created_at=func.now(),
        )
    )
    return incident_id


async def lock(conn: AsyncConnection, incident_id: uuid.UUID) -> IncidentRow | None:
    row = (
        await conn.execute(select(incidents).where(incidents.c.id == incident_id).with_for_update())
    ).one_or_none()
    return typed(IncidentRow, row._mapping) if row is not None else None


async def close(conn: AsyncConnection, incident_id: uuid.UUID, resolution: str) -> None:
    await conn.execute(
        update(incidents)
        .where(incidents.c.id == incident_id)
        .values(state=IncidentState.RESOLVED, resolved_at=func.now(), resolution=resolution)
    )


async def close_open_of_task(conn: AsyncConnection, task_id: uuid.UUID, resolution: str) -> None:
    """The open incidents holding a task end with it (its deadline withdrew it)."""
    await conn.execute(
        update(incidents)
        .where(incidents.c.task_id == task_id, is_(incidents.c.state, IncidentState.OPEN))
        .values(state=IncidentState.RESOLVED, resolved_at=func.now(), resolution=resolution)
    )


async def close_all_of_instance(
    conn: AsyncConnection, instance_id: uuid.UUID, resolution: str = INSTANCE_CANCELED
) -> None:
    await conn.execute(
        update(incidents)
        .where(incidents.c.instance_id == instance_id, is_(incidents.c.state, IncidentState.OPEN))
        .values(state=IncidentState.RESOLVED, resolved_at=func.now(), resolution=resolution)
    )


@dataclass(frozen=True)
class IncidentListing:
    """Which incidents a list shows: those matching every filter given ("" and None match any); a
    dependency is named as its incidents' details name it (`model:NAME`, `tool_server:NAME`)."""

    instance_id: uuid.UUID | None = None
    state: str = ""
    type: str = ""
    dependency: str = ""


async def listed(
    conn: AsyncConnection,
    which: IncidentListing = IncidentListing(),
    *,
    incident_id: uuid.UUID | None = None,
    limit: int = 1000,
    after_key: tuple[datetime, uuid.UUID] | None = None,
) -> list[ListedIncident]:
    """Incidents, oldest first (by `created_at`, then id), after `after_key`, the last row of the page before."""
    order = (incidents.c.created_at, incidents.c.id)
    query = keyset.ordered(
        select(incidents, instances.c.process_id).join(instances, instances.c.id == incidents.c.instance_id),
        order,
        after_key,
    )
    if incident_id is not None:
        query = query.where(incidents.c.id == incident_id)
    if which.instance_id is not None:
        query = query.where(incidents.c.instance_id == which.instance_id)
    if which.state:
        query = query.where(incidents.c.state == which.state)
    if which.type:
        query = query.where(incidents.c.type == which.type)
    if which.dependency:
        query = query.where(incidents.c.details["dependency"].astext == which.dependency)
    rows = (await conn.execute(query.limit(limit))).all()
    return [typed(ListedIncident, row._mapping) for row in rows]


async def open_counts_by_type(conn: AsyncConnection) -> dict[str, int]:
    rows = (
        await conn.execute(
            select(incidents.c.type, func.count().label("n"))
            .where(is_(incidents.c.state, IncidentState.OPEN))
            .group_by(incidents.c.type)
        )
    ).all()
    return {r.type: r.n for r in rows}


async def open_matching(
    conn: AsyncConnection, incident_type: str, *, dependency: str = "", process_id: str = "", limit: int
) -> tuple[list[uuid.UUID], int]:
    """The oldest `limit` open incidents of a type (and of a dependency, of a process), and how many
    match in all."""
    query = select(incidents.c.id).where(
        is_(incidents.c.state, IncidentState.OPEN), incidents.c.type == incident_type
    )
    if dependency:
        query = query.where(incidents.c.details["dependency"].astext == dependency)
    if process_id:
        query = query.join(instances, instances.c.id == incidents.c.instance_id).where(
            instances.c.process_id == process_id
        )
    total = (await conn.execute(select(func.count()).select_from(query.subquery()))).scalar_one()
    ids = (await conn.execute(query.order_by(incidents.c.created_at).limit(limit))).scalars().all()
    return list(ids), int(total)
