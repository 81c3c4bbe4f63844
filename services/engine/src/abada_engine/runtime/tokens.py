"""Persisting a token move (an `Advance`) inside the caller's transaction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.database import dumps as _dumps
from abada_engine.db.raw import RawSql
from abada_engine.db.schema import history, incidents

from .navigator import Advance, HistoryEntry

TASK_CHANNEL = "abada_tasks"


@dataclass(frozen=True)
class AppliedAdvance:
    task_id: uuid.UUID | None
    incident_id: uuid.UUID | None
    current_node_id: str
    completed: bool
    applied: bool = True


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


_APPLY_SQL = RawSql(
    """
    WITH finished AS (
        UPDATE tasks SET state = CAST(:finished_state AS text), completed_at = now(), lease_token_hash = NULL
        WHERE id = CAST(:finished_task_id AS uuid)
          AND (CAST(:guard_worker AS text) IS NULL OR (
               state = 'LEASED' AND lease_owner = CAST(:guard_worker AS text)
               AND lease_token_hash = CAST(:guard_hash AS bytea) AND lease_expires_at > now()
               AND EXISTS (SELECT 1 FROM instances WHERE id = CAST(:instance_id AS uuid) AND state = 'ACTIVE'
                           AND (CAST(:guard_xmin AS text) IS NULL OR xmin::text = CAST(:guard_xmin AS text)))))
        RETURNING id
    ),
    proceed AS (
        SELECT CAST(:finished_task_id AS uuid) IS NULL OR EXISTS (SELECT 1 FROM finished) AS ok
    ),
    new_task AS (
        INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at,
                           created_at)
        SELECT CAST(:task_id AS uuid), CAST(:instance_id AS uuid), CAST(:task_node AS text), CAST(:task_kind AS text),
               CAST(:task_topic AS text), CAST(:task_state AS text), CAST(:task_payload AS jsonb), 0,
               CAST(:task_retries AS integer), now(), now()
        FROM proceed WHERE proceed.ok AND CAST(:task_id AS uuid) IS NOT NULL
        RETURNING id
    ),
    new_incident AS (
        INSERT INTO incidents (id, instance_id, task_id, node_id, type, message, details, state, created_at)
        SELECT CAST(:incident_id AS uuid), CAST(:instance_id AS uuid), CAST(:incident_task AS uuid),
               CAST(:incident_node AS text), CAST(:incident_type AS text), CAST(:incident_message AS text),
               CAST(:incident_details AS jsonb), 'OPEN', now()
        FROM proceed WHERE proceed.ok AND CAST(:incident_id AS uuid) IS NOT NULL
        RETURNING id
    ),
    moved AS (
        UPDATE instances
        SET current_node_id = CAST(:current_node AS text),
            variables = COALESCE(CAST(:variables AS jsonb), variables),
            state = CASE WHEN CAST(:completed AS boolean) THEN 'COMPLETED' ELSE state END,
            ended_at = CASE WHEN CAST(:completed AS boolean) THEN now() ELSE ended_at END
        WHERE id = CAST(:instance_id AS uuid) AND (SELECT ok FROM proceed)
        RETURNING id
    ),
    written AS (
        INSERT INTO history (instance_id, type, node_id, task_id, data)
        SELECT CAST(:instance_id AS uuid), h.item ->> 'type', h.item ->> 'node_id',
               CAST(h.item ->> 'task_id' AS uuid), h.item -> 'data'
        FROM jsonb_array_elements(CAST(:history AS jsonb)) WITH ORDINALITY AS h(item, n)
        WHERE (SELECT ok FROM proceed)
        ORDER BY h.n
        RETURNING id
    )
    SELECT (SELECT ok FROM proceed) AS applied,
           CASE WHEN CAST(:task_topic AS text) IS NOT NULL AND (SELECT ok FROM proceed)
                THEN pg_notify(CAST(:channel AS text), CAST(:task_topic AS text)) END AS notified
    """
)


@dataclass(frozen=True)
class LeaseGuard:
    """Apply a move only if this worker still holds the live lease (checked inside the statement)."""

    worker_id: str
    token_hash: bytes
    # The instance row's xmin the decision was made on; None skips the check.
    instance_xmin: str | None = None


def _history_json(entries: list[tuple[HistoryEntry, uuid.UUID | None]]) -> str:
    return _dumps(
        [
            {"type": e.type, "node_id": e.node_id, "task_id": str(t) if t else None, "data": e.data}
            for e, t in entries
        ]
    )


async def apply_advance(
    conn: AsyncConnection,
    *,
    instance_id: uuid.UUID,
    advance: Advance,
    variables: dict[str, Any] | None,
    preceding: list[HistoryEntry],
    preceding_task_id: uuid.UUID | None = None,
    finished_task_id: uuid.UUID | None = None,
    guard: LeaseGuard | None = None,
    finished_state: str = "COMPLETED",
) -> AppliedAdvance:
    """Write what `advance` decided in one statement: the next task or incident, the instance's new
    position and variables, and the history, in order.

    `variables` is the instance's new variable map, or None when it did not change;
    `finished_task_id` is a task this move ends (in `finished_state`: COMPLETED, or INCIDENT when an
    incident holds it for a retry); with `guard`, only while that lease is live,
    and otherwise nothing at all is written (`applied` is False).
    """
    entries: list[tuple[HistoryEntry, uuid.UUID | None]] = [(e, preceding_task_id) for e in preceding]
    entries += [(e, None) for e in advance.history]
    task = advance.task
    task_id = uuid.uuid4() if task is not None else None
    if task is not None:
        created = "USER_TASK_CREATED" if task.kind == "user" else "TASK_CREATED"
        entries.append((HistoryEntry(created, task.node.id, {"topic": task.topic}), task_id))
    incident = advance.incident
    incident_id = uuid.uuid4() if incident is not None else None
    if incident is not None:
        entries.append(
            (
                HistoryEntry(
                    "INCIDENT_RAISED",
                    incident.node_id,
                    {"incident_id": str(incident_id), "type": incident.type, "message": incident.message},
                ),
                incident.task_id,
            )
        )
    result = await _APPLY_SQL.fetchrow(
        conn,
        {
            "guard_worker": guard.worker_id if guard else None,
            "guard_hash": guard.token_hash if guard else None,
            "guard_xmin": guard.instance_xmin if guard else None,
            "instance_id": str(instance_id),
            "task_id": str(task_id) if task_id else None,
            "task_node": task.node.id if task else None,
            "task_kind": task.kind if task else None,
            "task_topic": task.topic if task else None,
            "task_state": ("READY" if task.kind == "external" else "WAITING") if task else None,
            "task_payload": _dumps(task.payload) if task else None,
            "task_retries": task.retries if task else 0,
            "incident_id": str(incident_id) if incident_id else None,
            "incident_node": incident.node_id if incident else None,
            "incident_task": str(incident.task_id) if incident and incident.task_id else None,
            "finished_task_id": str(finished_task_id) if finished_task_id else None,
            "finished_state": finished_state,
            "incident_type": incident.type if incident else None,
            "incident_message": incident.message if incident else None,
            "incident_details": _dumps(incident.details) if incident else None,
            "current_node": advance.current_node_id,
            "variables": _dumps(variables) if variables is not None else None,
            "completed": advance.completed,
            "history": _history_json(entries),
            "channel": TASK_CHANNEL,
        },
    )
    applied = bool(result is not None and result.applied)
    return AppliedAdvance(task_id, incident_id, advance.current_node_id, advance.completed, applied)
