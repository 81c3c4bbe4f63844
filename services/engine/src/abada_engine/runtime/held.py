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

from abada_engine.runtime.flow.navigator import IncidentToRaise
from abada_engine.runtime.flow.tokens import history_record, write_history
from abada_engine.store import incidents as incident_store
from abada_engine.store import tasks as task_store
from abada_engine.store.history import HistoryRecord


async def hold_for_a_person(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    incident: IncidentToRaise,
    *,
    last_error: dict[str, Any] | None = None,
    give_back_attempt: bool = False,
    noted: dict[str, Any] | None = None,
    preceding: Sequence[HistoryRecord] = (),
) -> uuid.UUID:
    """Holds the incident's task and raises the incident (`raise_recorded_incident`); returns its id."""
    assert incident.task_id is not None  # what is held is a task
    await task_store.hold_as_incident(
        conn, incident.task_id, last_error=last_error, give_back_attempt=give_back_attempt
    )
    return await raise_recorded_incident(conn, instance_id, incident, noted=noted, preceding=preceding)


async def raise_recorded_incident(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    incident: IncidentToRaise,
    *,
    history_task_id: uuid.UUID | None = None,
    noted: dict[str, Any] | None = None,
    preceding: Sequence[HistoryRecord] = (),
) -> uuid.UUID:
    """Raises the incident and writes `preceding` then INCIDENT_RAISED (with what `noted` adds) to the
    history, one statement each; the history line names `history_task_id`, else the incident's task.
    Returns the incident's id."""
    incident_id = await incident_store.raise_incident(
        conn,
        instance_id=instance_id,
        node_id=incident.node_id,
        type_=incident.type,
        message=incident.message,
        details=incident.details,
        task_id=incident.task_id,
    )
    raised = history_record(
        instance_id, incident.raised(incident_id, noted), history_task_id or incident.task_id
    )
    await write_history(conn, [*preceding, raised])
    return incident_id
