"""Process instances: creating, reading with their open incidents, locking, cancelling."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, select, true, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import incidents, instances

from .hand_written import typed
from .states import IncidentState, InstanceState, is_


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


async def listed(
    conn: AsyncConnection,
    instance_id: uuid.UUID | None = None,
    process_id: str = "",
    state: str = "",
    limit: int = 100,
    offset: int = 0,
) -> list[ListedInstance]:
    """Instances, newest first, each with its count of open incidents."""
    condition: ColumnElement[bool] = true()
    if instance_id is not None:
        condition = condition & (instances.c.id == instance_id)
    if process_id:
        condition = condition & (instances.c.process_id == process_id)
    if state:
        condition = condition & (instances.c.state == state)
    open_incidents = (
        select(func.count())
        .where(incidents.c.instance_id == instances.c.id, is_(incidents.c.state, IncidentState.OPEN))
        .scalar_subquery()
    )
    query = (
        select(instances, open_incidents.label("open_incidents"))
        .where(condition)
        .order_by(instances.c.created_at.desc(), instances.c.id)
        .limit(limit)
        .offset(offset)
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
