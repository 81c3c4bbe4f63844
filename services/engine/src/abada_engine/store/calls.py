"""Call activities: the link from an instance a `call` node started to its parent, and the reads that
follow it both ways (a parent's children, a child's parent, a subtree to cancel)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import incidents, instances, tasks

from .hand_written import typed
from .states import IncidentState, InstanceState, TaskState, is_


@dataclass(slots=True)
class CalledInstance:
    """An instance a call activity started, with where it answers to."""

    id: uuid.UUID
    process_id: str
    version: int
    state: str
    variables: dict[str, Any]
    parent_instance_id: uuid.UUID
    parent_task_id: uuid.UUID


@dataclass(slots=True)
class ChildRow:
    instance_id: uuid.UUID
    process_id: str
    version: int
    state: str
    node_id: str
    open_incidents: int
    created_at: datetime


async def link_to_parent(
    conn: AsyncConnection, child_id: uuid.UUID, parent_id: uuid.UUID, parent_task_id: uuid.UUID
) -> None:
    await conn.execute(
        update(instances)
        .where(instances.c.id == child_id)
        .values(parent_instance_id=parent_id, parent_task_id=parent_task_id)
    )


async def business_key_of(conn: AsyncConnection, instance_id: uuid.UUID) -> str:
    key = await conn.scalar(select(instances.c.business_key).where(instances.c.id == instance_id))
    return str(key or "")


_CALLED_COLUMNS = (
    instances.c.id,
    instances.c.process_id,
    instances.c.version,
    instances.c.state,
    instances.c.variables,
    instances.c.parent_instance_id,
    instances.c.parent_task_id,
)


async def called_among(conn: AsyncConnection, instance_ids: list[uuid.UUID]) -> list[CalledInstance]:
    """Which of these instances a call activity started (their state and variables as now)."""
    rows = await conn.execute(
        select(*_CALLED_COLUMNS).where(
            instances.c.id.in_(instance_ids), instances.c.parent_task_id.is_not(None)
        )
    )
    return [typed(CalledInstance, row._mapping) for row in rows]


async def cancel_call_task(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """The call's task ends: its child ended without completing, and an incident holds the token."""
    await conn.execute(
        update(tasks).where(tasks.c.id == task_id).values(state=TaskState.CANCELED, completed_at=func.now())
    )


# The active instances below a parent, children first: of all its call tasks, of all but one (a join
# on `any` passed through that one), or of one alone (a token moved away from it).
_ACTIVE_SUBTREE = text(
    f"""
    WITH RECURSIVE below(id, depth) AS (
        SELECT i.id, 1 FROM instances i
        WHERE i.parent_instance_id = :parent AND i.state = '{InstanceState.ACTIVE}'
          AND (CAST(:but_task AS uuid) IS NULL OR i.parent_task_id <> CAST(:but_task AS uuid))
          AND (CAST(:only_task AS uuid) IS NULL OR i.parent_task_id = CAST(:only_task AS uuid))
        UNION ALL
        SELECT i.id, b.depth + 1 FROM instances i JOIN below b ON i.parent_instance_id = b.id
        WHERE i.state = '{InstanceState.ACTIVE}'
    )
    SELECT id FROM below ORDER BY depth
    """
)


async def active_subtree(
    conn: AsyncConnection,
    parent_id: uuid.UUID,
    *,
    but_task: uuid.UUID | None = None,
    only_task: uuid.UUID | None = None,
) -> list[uuid.UUID]:
    rows = await conn.execute(
        _ACTIVE_SUBTREE, {"parent": parent_id, "but_task": but_task, "only_task": only_task}
    )
    return [row.id for row in rows]


async def children_of(conn: AsyncConnection, parent_id: uuid.UUID) -> list[ChildRow]:
    """The instances a parent's call activities started, oldest first, with their open incidents."""
    open_incidents = (
        select(func.count())
        .where(incidents.c.instance_id == instances.c.id, is_(incidents.c.state, IncidentState.OPEN))
        .scalar_subquery()
    )
    node_id = select(tasks.c.node_id).where(tasks.c.id == instances.c.parent_task_id).scalar_subquery()
    rows = await conn.execute(
        select(
            instances.c.id.label("instance_id"),
            instances.c.process_id,
            instances.c.version,
            instances.c.state,
            func.coalesce(node_id, "").label("node_id"),
            open_incidents.label("open_incidents"),
            instances.c.created_at,
        )
        .where(instances.c.parent_instance_id == parent_id)
        .order_by(instances.c.created_at, instances.c.id)
    )
    return [typed(ChildRow, row._mapping) for row in rows]
