"""A `for_each` node's max_cost_usd, shared by all its items: what they spent, under the fan-out's lock,
and holding the items a spent budget stopped under the one incident it raised."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, Text, cast, func, literal, select
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import tasks

from .hand_written import Executor, HandWritten
from .states import IncidentState, StepKind, StepState, TaskState


# Items of one fan-out deciding on its budget take this lock in turn, for the rest of the transaction that
# also journals the call's STARTED: the next item's check (a statement after the lock, so a snapshot
# after it) sees the call in flight. Advisory, so it orders nothing but these checks: a completion moving
# the fan-out never waits for it.
def _lock_fan_out_budget(task_id: uuid.UUID) -> Select[tuple[uuid.UUID | None, Any]]:
    lock_key = func.hashtextextended(literal("abada fan-out budget ") + cast(tasks.c.fan_out_id, Text), 0)
    return select(tasks.c.fan_out_id, func.pg_advisory_xact_lock(lock_key)).where(
        tasks.c.id == task_id, tasks.c.fan_out_id.is_not(None)
    )


# Item by item (its tasks through the fan-out's index, each one's steps through the journal's key), so the
# plan cannot become a scan of the whole journal however stale the statistics: the cost follows the
# fan-out's own items and steps. (OFFSET 0 keeps the planner from flattening the per-item read into a
# join it may then plan as a scan.)
_FAN_OUT_SPEND = HandWritten(
    f"""
    WITH items AS MATERIALIZED (SELECT id FROM tasks WHERE fan_out_id = CAST(:fan_out_id AS uuid))
    SELECT COALESCE(sum(s.input_tokens), 0) AS input_tokens, COALESCE(sum(s.output_tokens), 0) AS output_tokens,
           COALESCE(max(s.input_tokens * CAST(:input_usd AS float8) + s.output_tokens * CAST(:output_usd AS float8))
                    FILTER (WHERE s.state <> '{StepState.STARTED}'), 0) AS dearest_call_usd,
           count(*) FILTER (WHERE s.state = '{StepState.STARTED}' AND NOT s.abandoned) AS calls_in_flight
    FROM items CROSS JOIN LATERAL (
        SELECT input_tokens, output_tokens, state, abandoned FROM journal_steps
        WHERE task_id = items.id AND kind = '{StepKind.MODEL_CALL}' OFFSET 0
    ) s
    """
)


@dataclass(frozen=True)
class FanOutSpend:
    """The model calls of every item of one fan-out: tokens journaled (abandoned calls included: they
    were paid for), the dearest finished call, and the calls begun and not yet finished."""

    fan_out_id: uuid.UUID
    input_tokens: int
    output_tokens: int
    dearest_call_usd: float
    calls_in_flight: int


async def lock_fan_out_spend(
    conn: AsyncConnection, task_id: uuid.UUID, input_usd_per_token: float, output_usd_per_token: float
) -> FanOutSpend | None:
    """Inside the caller's transaction: wait for the task's fan-out's budget, then read what its items
    spent. None when the task is no item of a fan-out."""
    locked = (await conn.execute(_lock_fan_out_budget(task_id))).one_or_none()
    if locked is None:
        return None
    fan_out_id = locked.fan_out_id
    row = await _FAN_OUT_SPEND.fetchrow(
        conn,
        {"fan_out_id": str(fan_out_id), "input_usd": input_usd_per_token, "output_usd": output_usd_per_token},
    )
    assert row is not None  # an aggregate always answers
    return FanOutSpend(
        fan_out_id,
        int(row.input_tokens),
        int(row.output_tokens),
        float(row.dearest_call_usd),
        int(row.calls_in_flight),
    )


# The item whose call was refused stops where it is: no lease, held like a task an incident holds. Only
# its lease holder's own refused call gets here (the journal proved the claim first).
_HOLD_ITEM = HandWritten(
    f"""
    UPDATE tasks SET state = '{TaskState.INCIDENT}', lease_owner = NULL, lease_token_hash = NULL,
        lease_expires_at = NULL, last_error = CAST(CAST(:error AS text) AS jsonb)
    WHERE id = CAST(:task_id AS uuid) AND state = '{TaskState.LEASED}' AND fan_out_id IS NOT NULL
      AND lease_owner = CAST(:worker_id AS text) AND attempt = CAST(:attempt AS integer)
    RETURNING instance_id, node_id, fan_out_id
    """
)

_OPEN_INCIDENT_OF_FAN_OUT = HandWritten(
    f"""
    SELECT i.id FROM incidents i JOIN tasks t ON t.id = i.task_id
    WHERE i.instance_id = CAST(:instance_id AS uuid) AND i.state = '{IncidentState.OPEN}'
      AND i.type = CAST(:type AS text) AND t.fan_out_id = CAST(:fan_out_id AS uuid)
      AND i.details -> 'details' ->> 'scope' = CAST(:scope AS text)
    ORDER BY i.created_at LIMIT 1
    """
)

# The items held beside an incident without one of their own (stopped by the budget it was raised for)
# go back to the queue with it.
_OFFER_HELD_ITEMS = HandWritten(
    f"""
    UPDATE tasks t SET state = '{TaskState.READY}', due_at = now(), retries_left = CAST(:retries AS integer)
    WHERE t.fan_out_id = (SELECT fan_out_id FROM tasks WHERE id = CAST(:task_id AS uuid))
      AND t.state = '{TaskState.INCIDENT}' AND t.id <> CAST(:task_id AS uuid)
      AND NOT EXISTS (SELECT 1 FROM incidents i WHERE i.task_id = t.id AND i.state = '{IncidentState.OPEN}')
    RETURNING t.topic
    """
)


@dataclass(frozen=True)
class HeldItem:
    instance_id: uuid.UUID
    node_id: str
    fan_out_id: uuid.UUID


async def hold_item(
    conn: Executor, task_id: uuid.UUID, worker_id: str, attempt: int, error: dict[str, Any]
) -> HeldItem | None:
    """Stop the item (no lease, held as an incident holds a task) if this worker still holds it at this
    attempt; None if not (its lease went meanwhile)."""
    row = await _HOLD_ITEM.fetchrow(
        conn,
        {"task_id": str(task_id), "worker_id": worker_id, "attempt": attempt, "error": json.dumps(error)},
    )
    return HeldItem(row.instance_id, row.node_id, row.fan_out_id) if row is not None else None


async def open_incident_of_fan_out(
    conn: Executor, instance_id: uuid.UUID, fan_out_id: uuid.UUID, incident_type: str, scope: str
) -> uuid.UUID | None:
    """The oldest open incident of this type on one of the fan-out's items, raised for a refusal of this
    `scope` (an item's own limit raises incidents of the same type)."""
    row = await _OPEN_INCIDENT_OF_FAN_OUT.fetchrow(
        conn,
        {
            "instance_id": str(instance_id),
            "fan_out_id": str(fan_out_id),
            "type": incident_type,
            "scope": scope,
        },
    )
    return row.id if row is not None else None


async def offer_held_items(conn: Executor, task_id: uuid.UUID, retries_left: int) -> set[str]:
    """Offer again the items of `task_id`'s fan-out held without an incident of their own; the topics
    to wake."""
    rows = await _OFFER_HELD_ITEMS.fetch(conn, {"task_id": str(task_id), "retries": retries_left})
    return {row.topic for row in rows if row.topic is not None}
