"""Repairing running instances: an operator's variable changes, token moves, and migrations to another
version of the process. One function per transition; the runtime (runtime/repairs.py) decides."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Table, bindparam, cast, func, literal, select, type_coerce, update
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import Text

from abada_engine.db.schema import approvals, incidents, instances, tasks, timers

from .hand_written import typed
from .states import OPEN_TASK_STATES, ApprovalState, IncidentState, InstanceState, is_, one_of


@dataclass(frozen=True, slots=True)
class OpenTask:
    id: uuid.UUID
    node_id: str
    kind: str
    state: str
    payload: dict[str, Any]


async def lock_open_task_at(conn: AsyncConnection, instance_id: uuid.UUID, node_id: str) -> OpenTask | None:
    """The instance's open task at `node_id` (the token resting there), locked; None when none rests there."""
    row = (
        await conn.execute(
            select(tasks.c.id, tasks.c.node_id, tasks.c.kind, tasks.c.state, tasks.c.payload)
            .where(
                tasks.c.instance_id == instance_id,
                tasks.c.node_id == node_id,
                one_of(tasks.c.state, OPEN_TASK_STATES),
            )
            .order_by(tasks.c.created_at)
            .limit(1)
            .with_for_update()
        )
    ).one_or_none()
    return typed(OpenTask, row._mapping) if row is not None else None


async def lock_taskless_incident_at(
    conn: AsyncConnection, instance_id: uuid.UUID, node_id: str
) -> uuid.UUID | None:
    """The instance's open incident at `node_id` that holds no task (a token stuck at a gateway, say),
    locked; None when there is none."""
    return await conn.scalar(
        select(incidents.c.id)
        .where(
            incidents.c.instance_id == instance_id,
            incidents.c.node_id == node_id,
            incidents.c.task_id.is_(None),
            is_(incidents.c.state, IncidentState.OPEN),
        )
        .order_by(incidents.c.created_at)
        .limit(1)
        .with_for_update()
    )


async def change_variables(
    conn: AsyncConnection, instance_id: uuid.UUID, values: dict[str, Any], removed: Sequence[str]
) -> None:
    """Remove the names in `removed`, then set `values` (each replacing the whole value under its name)."""
    variables: Any = instances.c.variables
    if removed:
        variables = variables.op("-")(cast(literal(list(removed), ARRAY(Text)), ARRAY(Text)))
    if values:
        variables = variables.op("||")(type_coerce(values, JSONB))
    await conn.execute(update(instances).where(instances.c.id == instance_id).values(variables=variables))


async def active_of_definition(
    conn: AsyncConnection, definition_id: uuid.UUID, instance_ids: Sequence[uuid.UUID]
) -> list[uuid.UUID]:
    """The active instances of one definition (only those of `instance_ids` when given), oldest first."""
    query = select(instances.c.id).where(
        instances.c.definition_id == definition_id, is_(instances.c.state, InstanceState.ACTIVE)
    )
    if instance_ids:
        query = query.where(instances.c.id.in_(list(instance_ids)))
    rows = await conn.execute(query.order_by(instances.c.created_at, instances.c.id))
    return [row.id for row in rows]


async def token_nodes(conn: AsyncConnection, instance_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, set[str]]:
    """Where each instance's tokens rest: the nodes of its open tasks and of its open incidents."""
    ids = list(instance_ids)
    if not ids:
        return {}
    at_tasks = select(tasks.c.instance_id, tasks.c.node_id).where(
        tasks.c.instance_id.in_(ids), one_of(tasks.c.state, OPEN_TASK_STATES)
    )
    at_incidents = select(incidents.c.instance_id, incidents.c.node_id).where(
        incidents.c.instance_id.in_(ids), is_(incidents.c.state, IncidentState.OPEN)
    )
    found: dict[uuid.UUID, set[str]] = {i: set() for i in ids}
    for row in await conn.execute(at_tasks.union(at_incidents)):
        found[row.instance_id].add(row.node_id)
    return found


async def lock_active(
    conn: AsyncConnection, instance_id: uuid.UUID, definition_id: uuid.UUID
) -> tuple[str, dict[str, Any]] | None:
    """Lock an instance still active on `definition_id`: its current node and variables, or None when
    it finished or moved on."""
    row = (
        await conn.execute(
            select(instances.c.current_node_id, instances.c.variables)
            .where(
                instances.c.id == instance_id,
                instances.c.definition_id == definition_id,
                is_(instances.c.state, InstanceState.ACTIVE),
            )
            .with_for_update()
        )
    ).one_or_none()
    return None if row is None else (str(row.current_node_id or ""), dict(row.variables))


async def lock_open_tasks(conn: AsyncConnection, instance_id: uuid.UUID) -> list[OpenTask]:
    rows = await conn.execute(
        select(tasks.c.id, tasks.c.node_id, tasks.c.kind, tasks.c.state, tasks.c.payload)
        .where(tasks.c.instance_id == instance_id, one_of(tasks.c.state, OPEN_TASK_STATES))
        .order_by(tasks.c.id)
        .with_for_update()
    )
    return [typed(OpenTask, row._mapping) for row in rows]


async def move_to_definition(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    definition_id: uuid.UUID,
    version: int,
    current_node_id: str,
) -> None:
    await conn.execute(
        update(instances)
        .where(instances.c.id == instance_id)
        .values(definition_id=definition_id, version=version, current_node_id=current_node_id)
    )


async def rename_open_task(
    conn: AsyncConnection, task_id: uuid.UUID, node_id: str, payload: dict[str, Any]
) -> None:
    """A migrated task: its node in the new version and what its next attempt is given. The lease of
    an attempt in flight is left alone."""
    await conn.execute(update(tasks).where(tasks.c.id == task_id).values(node_id=node_id, payload=payload))


async def rename_waiting_nodes(
    conn: AsyncConnection, instance_id: uuid.UUID, renames: dict[str, str]
) -> None:
    """The unfired due times, pending approvals and open incidents of a migrated instance follow its
    renamed nodes."""
    if not renames:
        return
    await _rename_nodes(conn, timers, instance_id, renames, timers.c.fired_at.is_(None))
    await _rename_nodes(conn, approvals, instance_id, renames, is_(approvals.c.state, ApprovalState.PENDING))
    await _rename_nodes(conn, incidents, instance_id, renames, is_(incidents.c.state, IncidentState.OPEN))


async def _rename_nodes(
    conn: AsyncConnection,
    table: Table,
    instance_id: uuid.UUID,
    renames: dict[str, str],
    still_open: ColumnElement[bool],
) -> None:
    """The rows of `table` of the instance that are `still_open`, at a renamed node, moved to its new id."""
    mapped = func.jsonb_extract_path_text(bindparam("renames", renames, type_=JSONB), table.c.node_id)
    await conn.execute(
        update(table)
        .where(table.c.instance_id == instance_id, still_open, table.c.node_id.in_(renames))
        .values(node_id=mapped)
    )
