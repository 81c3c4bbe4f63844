"""Due times: claiming the ones that passed, once across replicas, and reading the next one."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from .hand_written import PLANNED_ONCE, typed
from .states import InstanceState, TaskKind

# Every transaction that sets a due time tells every replica the earliest one it set (epoch seconds).
TIMER_CHANNEL = "abada_timers"


@dataclass(slots=True)
class DueTimer:
    id: int
    instance_id: uuid.UUID
    task_id: uuid.UUID
    node_id: str
    kind: str
    due_at: datetime
    fired_at: datetime
    task_state: str
    task_kind: str
    task_payload: dict[str, Any]
    definition_id: uuid.UUID
    variables: dict[str, Any]
    instance_active: bool


# The passed due times, oldest first, marked fired in the claiming transaction: a replica that claims
# one holds it until it commits (the others skip it), and if it dies first the claim rolls back and
# another replica fires it. With the task and instance it belongs to, read in the same statement.
# "Passed" is as of the transaction's start (`now()`, the round's first statement): a time fixed for
# the statement bounds the scan of `timers_due`, where `clock_timestamp()`, read row by row, made
# every round walk past every future due time (12 ms a round with 100,000 waiting).
_CLAIM_DUE = text(
    f"""
    WITH due AS (
        SELECT id FROM timers
        WHERE fired_at IS NULL AND due_at <= now()
        ORDER BY due_at
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ),
    fired AS (
        UPDATE timers t SET fired_at = clock_timestamp() FROM due WHERE t.id = due.id
        RETURNING t.id, t.instance_id, t.task_id, t.node_id, t.kind, t.due_at, t.fired_at
    )
    SELECT f.*, k.state AS task_state, k.kind AS task_kind, k.payload AS task_payload, i.definition_id,
           i.variables, i.state = '{InstanceState.ACTIVE}' AS instance_active
    FROM fired f JOIN tasks k ON k.id = f.task_id JOIN instances i ON i.id = f.instance_id
    ORDER BY f.due_at
    """
)


# A firing round commits without waiting for its WAL to reach the disk: the walwriter flushes it within
# a fraction of a second, and the calls' own commits (FetchAndLock, Complete) stop queueing behind a
# flush of the round's rows. Nothing is lost that matters: a round lost in a database crash left its due
# times unfired, and they fire again after recovery; and anything built on a round's result (a worker
# leasing a task it created, a Complete of one) commits synchronously after it, which flushes the
# round's WAL first (WAL is flushed in order). Its statements are planned once per connection, as the
# hot statements are (`hand_written.PLANNED_ONCE`): a round's moves are the same statement every time.
_ROUND_SETTINGS = text(
    "SELECT set_config('synchronous_commit', 'off', true), "
    + ", ".join(f"set_config('{name}', '{value}', true)" for name, value in PLANNED_ONCE.items())
)


async def claim_due(conn: AsyncConnection, limit: int) -> list[DueTimer]:
    """Up to `limit` passed due times, claimed (fired) in the caller's transaction, which commits
    without waiting for the disk (see `_ROUND_SETTINGS`)."""
    await conn.execute(_ROUND_SETTINGS)
    rows = await conn.execute(_CLAIM_DUE, {"limit": limit})
    return [typed(DueTimer, r._mapping) for r in rows.all()]


# Seconds from the database's now to the earliest unfired due time (negative when one is overdue),
# and the database's now: a replica sleeps by the database's clock, not its own.
_NEXT_DUE = text(
    """
    SELECT EXTRACT(EPOCH FROM (SELECT min(due_at) FROM timers WHERE fired_at IS NULL)) AS due,
           EXTRACT(EPOCH FROM clock_timestamp()) AS now
    """
)


async def next_due(conn: AsyncConnection) -> tuple[float | None, float]:
    """The earliest unfired due time and the database's now, both as epoch seconds."""
    row = (await conn.execute(_NEXT_DUE)).one()
    return (float(row.due) if row.due is not None else None), float(row.now)


# What an instance waits on and waited on: its due times (fired or not), and its receives with the
# message each waits for (a receive's "due time" is its timeout's, fired when it was answered).
_WAITS_OF_INSTANCE = text(
    f"""
    SELECT t.kind, t.node_id, t.task_id, t.due_at, t.fired_at, NULL AS message, NULL AS correlation_key,
           t.due_at AS sort_at
    FROM timers t WHERE t.instance_id = :instance_id
    UNION ALL
    SELECT 'MESSAGE', k.node_id, k.id, NULL, k.completed_at, k.payload ->> 'message',
           k.payload ->> 'correlation_key', k.created_at
    FROM tasks k WHERE k.instance_id = :instance_id AND k.kind = '{TaskKind.RECEIVE}'
    ORDER BY sort_at, task_id
    """
)


@dataclass(slots=True)
class WaitRow:
    kind: str  # a TimerKind, or MESSAGE for a receive
    node_id: str
    task_id: uuid.UUID
    due_at: datetime | None
    fired_at: datetime | None
    message: str | None
    correlation_key: str | None


async def waits_of_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> list[WaitRow]:
    rows = await conn.execute(_WAITS_OF_INSTANCE, {"instance_id": instance_id})
    return [typed(WaitRow, r._mapping) for r in rows.all()]
