"""The tokens of an instance with parallel branches: each rests at an open task, or at an open incident
that holds no task. Nothing else records them, so a one-token instance pays nothing for them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import incidents, instances, tasks

from .states import OPEN_TASK_STATES, IncidentState, TaskState, is_, one_of


@dataclass(frozen=True, slots=True)
class LockedTokens:
    # How many tokens of the instance are live besides the one moving (whose task is `but`).
    elsewhere: int
    # The instance row's version (xmin) once locked: the decision is made on this one.
    instance_xmin: str
    instance_state: str


async def lock_tokens(
    conn: AsyncConnection, instance_id: uuid.UUID, but: uuid.UUID | None, *, lock_tasks: bool = True
) -> LockedTokens | None:
    """Lock the instance's open tasks (in id order), then the instance, and count the live tokens
    besides the one leaving task `but`. The order is the one-statement move's (its task, then its
    instance), so a join waiting here and a branch moving on never wait for each other in a circle;
    the count is read after the locks, so it sees every move that committed before them. Without
    `lock_tasks` (the caller holds the instance already) only the instance is locked."""
    if lock_tasks:
        await conn.execute(
            select(tasks.c.id)
            .where(tasks.c.instance_id == instance_id, one_of(tasks.c.state, OPEN_TASK_STATES))
            .order_by(tasks.c.id)
            .with_for_update()
        )
    row = (
        await conn.execute(
            select(literal_column("xmin::text").label("xmin"), instances.c.state)
            .select_from(instances)
            .where(instances.c.id == instance_id)
            .with_for_update()
        )
    ).one_or_none()
    if row is None:
        return None
    open_tasks = (
        select(func.count())
        .select_from(tasks)
        .where(tasks.c.instance_id == instance_id, one_of(tasks.c.state, OPEN_TASK_STATES))
        .where(tasks.c.id != but if but is not None else tasks.c.id.is_not(None))
        .scalar_subquery()
    )
    taskless_incidents = (
        select(func.count())
        .select_from(incidents)
        .where(
            incidents.c.instance_id == instance_id,
            is_(incidents.c.state, IncidentState.OPEN),
            incidents.c.task_id.is_(None),
        )
        .scalar_subquery()
    )
    elsewhere = await conn.scalar(select(open_tasks + taskless_incidents))
    return LockedTokens(int(elsewhere or 0), row.xmin, row.state)


async def active_nodes(conn: AsyncConnection, instance_id: uuid.UUID) -> list[str]:
    """Where the instance's live tokens rest: the nodes of its open tasks and of its open incidents
    that hold no task, in the order they were reached."""
    # An item of a `for_each` waiting for its turn rests nowhere yet.
    resting = tuple(state for state in OPEN_TASK_STATES if state != TaskState.PENDING)
    at_tasks = select(tasks.c.node_id, tasks.c.created_at).where(
        tasks.c.instance_id == instance_id, one_of(tasks.c.state, resting)
    )
    at_incidents = select(incidents.c.node_id, incidents.c.created_at).where(
        incidents.c.instance_id == instance_id,
        is_(incidents.c.state, IncidentState.OPEN),
        incidents.c.task_id.is_(None),
    )
    union = at_tasks.union_all(at_incidents).subquery()
    rows = await conn.execute(select(union.c.node_id).order_by(union.c.created_at, union.c.node_id))
    return [row.node_id for row in rows]
