"""Persisting a token move (an `Advance`) inside the caller's transaction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import history, incidents, instances, tasks

from .navigator import Advance, HistoryEntry

TASK_CHANNEL = "abada_tasks"


@dataclass(frozen=True)
class AppliedAdvance:
    task_id: uuid.UUID | None
    incident_id: uuid.UUID | None
    current_node_id: str
    completed: bool


def history_row(
    instance_id: uuid.UUID, entry: HistoryEntry, task_id: uuid.UUID | None = None
) -> dict[str, Any]:
    return {
        "instance_id": instance_id,
        "type": entry.type,
        "node_id": entry.node_id,
        "task_id": task_id,
        "data": entry.data,
    }


async def write_history(conn: AsyncConnection, rows: list[dict[str, Any]]) -> None:
    if rows:
        await conn.execute(insert(history), rows)


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
    incident_id = uuid.uuid4()
    await conn.execute(
        insert(incidents).values(
            id=incident_id,
            instance_id=instance_id,
            task_id=task_id,
            node_id=node_id,
            type=type_,
            message=message,
            details=details or {},
            state="OPEN",
            created_at=func.now(),
        )
    )
    return incident_id


async def apply_advance(
    conn: AsyncConnection,
    *,
    instance_id: uuid.UUID,
    advance: Advance,
    variables: dict[str, Any] | None,
    preceding: list[HistoryEntry],
    preceding_task_id: uuid.UUID | None = None,
) -> AppliedAdvance:
    """Write what `advance` decided: the next task or incident, the instance's new position, history.

    `variables` is the instance's new variable map, or None when it did not change.
    """
    rows = [history_row(instance_id, entry, preceding_task_id) for entry in preceding]
    task_id: uuid.UUID | None = None
    incident_id: uuid.UUID | None = None
    if advance.task is not None:
        task_id = uuid.uuid4()
        spec = advance.task
        await conn.execute(
            insert(tasks).values(
                id=task_id,
                instance_id=instance_id,
                node_id=spec.node.id,
                kind=spec.kind,
                topic=spec.topic,
                state="READY" if spec.kind == "external" else "WAITING",
                payload=spec.payload,
                attempt=0,
                retries_left=spec.retries,
                due_at=func.now(),
                created_at=func.now(),
            )
        )
        if spec.topic:
            await conn.execute(
                text("SELECT pg_notify(:channel, :topic)"), {"channel": TASK_CHANNEL, "topic": spec.topic}
            )
    rows += [history_row(instance_id, entry, None) for entry in advance.history]
    if advance.task is not None:
        created = "USER_TASK_CREATED" if advance.task.kind == "user" else "TASK_CREATED"
        rows.append(
            history_row(
                instance_id,
                HistoryEntry(created, advance.task.node.id, {"topic": advance.task.topic}),
                task_id,
            )
        )
    if advance.incident is not None:
        found = advance.incident
        incident_id = await raise_incident(
            conn,
            instance_id=instance_id,
            node_id=found.node_id,
            type_=found.type,
            message=found.message,
            details=found.details,
        )
        rows.append(
            history_row(
                instance_id,
                HistoryEntry(
                    "INCIDENT_RAISED",
                    found.node_id,
                    {"incident_id": str(incident_id), "type": found.type, "message": found.message},
                ),
            )
        )
    values: dict[str, Any] = {"current_node_id": advance.current_node_id}
    if variables is not None:
        values["variables"] = variables
    if advance.completed:
        values.update(state="COMPLETED", ended_at=func.now())
    await conn.execute(update(instances).where(instances.c.id == instance_id).values(**values))
    await write_history(conn, rows)
    return AppliedAdvance(task_id, incident_id, advance.current_node_id, advance.completed)
