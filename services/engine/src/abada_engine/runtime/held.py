"""Holding a task for a person: the task stops, an incident says why, and the history records it.

Every place where the engine itself decides a task needs a person (an outage past its budget, a
journal that cannot be read, a write of unknown outcome, an approval nobody gave in time) does these
three writes together, in the caller's transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.runtime.flow.navigator import HistoryEntry
from abada_engine.runtime.flow.tokens import history_record, write_history
from abada_engine.store import incidents as incident_store
from abada_engine.store import tasks as task_store
from abada_engine.store.history import HistoryRecord


async def hold_for_a_person(
    conn: AsyncConnection,
    *,
    task_id: uuid.UUID,
    instance_id: uuid.UUID,
    node_id: str,
    type_: str,
    message: str,
    details: dict[str, Any],
    last_error: dict[str, Any] | None = None,
    give_back_attempt: bool = False,
    noted: dict[str, Any] | None = None,
    preceding: Sequence[HistoryRecord] = (),
) -> uuid.UUID:
    """Holds the task as an incident of `type_` and writes `preceding` then INCIDENT_RAISED (with what
    `noted` adds) to the history; returns the incident's id."""
    await task_store.hold_as_incident(
        conn, task_id, last_error=last_error, give_back_attempt=give_back_attempt
    )
    return await raise_recorded_incident(
        conn,
        instance_id=instance_id,
        node_id=node_id,
        type_=type_,
        message=message,
        details=details,
        task_id=task_id,
        noted=noted,
        preceding=preceding,
    )


async def raise_recorded_incident(
    conn: AsyncConnection,
    *,
    instance_id: uuid.UUID,
    node_id: str,
    type_: str,
    message: str,
    details: dict[str, Any],
    task_id: uuid.UUID | None = None,
    history_task_id: uuid.UUID | None = None,
    noted: dict[str, Any] | None = None,
    preceding: Sequence[HistoryRecord] = (),
) -> uuid.UUID:
    """Raises an incident of `type_` (on `task_id`, if any) and writes `preceding` then INCIDENT_RAISED
    (with what `noted` adds) to the history, in one statement each; the history line names
    `history_task_id`, else `task_id`. Returns the incident's id."""
    incident_id = await incident_store.raise_incident(
        conn,
        instance_id=instance_id,
        node_id=node_id,
        type_=type_,
        message=message,
        details=details,
        task_id=task_id,
    )
    raised = HistoryEntry(
        "INCIDENT_RAISED",
        node_id,
        {"incident_id": str(incident_id), "type": type_, "message": message, **(noted or {})},
    )
    recorded = history_record(instance_id, raised, history_task_id or task_id)
    await write_history(conn, [*preceding, recorded])
    return incident_id
