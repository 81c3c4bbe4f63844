"""The items of a `for_each` node: each a task of its own, found by its fan-out and index.

Item i's end offers item i + max_concurrency (PENDING until then), so at most max_concurrency items
run at once and no end waits on a counter shared by all. An item j still open keeps j + c, j + 2c, ...
PENDING, so the fan-out is over exactly when its last max_concurrency items have ended: only their
ends ask, under the fan-out row's lock, and count no more than those few rows.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.database import dumps
from abada_engine.db.schema import fan_outs, tasks

from .hand_written import Executor, HandWritten
from .history import HistoryRecord
from .states import OPEN_TASK_STATES, FanOutState, TaskKind, TaskState, one_of
from .tasks import TASK_CHANNEL

# Hand-written: every item's end runs it. Ends the item (under its lease when `guard_worker` is set,
# else only while it is in `from_state`), keeps what it gave, offers the item max_concurrency places
# later and writes the item's history; nothing at all unless the item ended. Answers the item's
# place and whether it is among the last max_concurrency (whose end may be the fan-out's).
FINISH_ITEM = HandWritten(
    f"""
    WITH finished AS (
        UPDATE tasks t
        SET state = CAST(:state AS text), completed_at = now(), lease_token_hash = NULL,
            item_result = CAST(:result AS jsonb)
        WHERE t.id = CAST(:task_id AS uuid) AND t.fan_out_id IS NOT NULL
          AND (CAST(:guard_worker AS text) IS NULL OR (
               t.state = '{TaskState.LEASED}' AND t.lease_owner = CAST(:guard_worker AS text)
               AND t.lease_token_hash = decode(CAST(:guard_hash AS text), 'hex') AND t.lease_expires_at > now()))
          AND (CAST(:from_state AS text) IS NULL OR t.state = CAST(:from_state AS text))
        RETURNING t.instance_id, t.fan_out_id, t.item_index
    ),
    fan AS (
        SELECT f.id, f.total, f.max_concurrency FROM fan_outs f JOIN finished ON f.id = finished.fan_out_id
    ),
    offered AS (
        UPDATE tasks n
        SET state = CASE WHEN n.kind = '{TaskKind.EXTERNAL}' THEN '{TaskState.READY}'
                         ELSE '{TaskState.WAITING}' END,
            due_at = now(), created_at = now()
        FROM finished, fan
        WHERE n.fan_out_id = finished.fan_out_id AND n.item_index = finished.item_index + fan.max_concurrency
          AND n.state = '{TaskState.PENDING}'
        RETURNING n.topic, n.kind
    ),
    written AS (
        INSERT INTO history (instance_id, type, node_id, task_id, data)
        SELECT finished.instance_id, h.item ->> 'type', h.item ->> 'node_id', CAST(:task_id AS uuid),
               (h.item -> 'data') || jsonb_build_object('item_index', finished.item_index)
        FROM finished, jsonb_array_elements(CAST(:history AS jsonb)) WITH ORDINALITY AS h(item, k)
        ORDER BY h.k
        RETURNING id
    ),
    notified AS (
        SELECT count(pg_notify(CAST(:channel AS text), topic)) AS topics
        FROM (SELECT DISTINCT topic FROM offered WHERE topic IS NOT NULL AND kind = '{TaskKind.EXTERNAL}') AS o
    )
    SELECT finished.fan_out_id, finished.item_index,
           finished.item_index + fan.max_concurrency >= fan.total AS last_round,
           (SELECT topics FROM notified) AS notified, (SELECT count(*) FROM written) AS lines
    FROM finished, fan
    """
)


@dataclass(frozen=True, slots=True)
class FinishedItem:
    fan_out_id: uuid.UUID
    item_index: int
    # Among the last max_concurrency items: its end may be the fan-out's (`end_if_done`).
    last_round: bool


async def finish_item(
    conn: Executor,
    task_id: uuid.UUID,
    *,
    state: TaskState,
    result: Any,
    history: list[HistoryRecord],
    guard_worker: str | None = None,
    guard_hash: bytes | None = None,
    from_state: TaskState | None = None,
) -> FinishedItem | None:
    """End an item (COMPLETED, or SKIPPED) keeping `result`, and offer the next one; None when the lease
    (or `from_state`) no longer held, and then nothing was written."""
    rows = await FINISH_ITEM.fetch(
        conn,
        {
            "task_id": str(task_id),
            "state": state.value,
            "result": dumps(result),
            "guard_worker": guard_worker,
            "guard_hash": guard_hash.hex() if guard_hash is not None else None,
            "from_state": from_state.value if from_state is not None else None,
            "history": dumps([{"type": r.type, "node_id": r.node_id, "data": r.data} for r in history]),
            "channel": TASK_CHANNEL,
        },
    )
    if not rows:
        return None
    row = rows[0]
    return FinishedItem(row["fan_out_id"], row["item_index"], bool(row["last_round"]))


@dataclass(frozen=True, slots=True)
class FanOutEnded:
    # Each item's result in the list's order: null for a skipped item.
    results: list[Any]
    skipped: int


async def end_if_done(conn: AsyncConnection, fan_out_id: uuid.UUID) -> FanOutEnded | None:
    """In the caller's transaction: lock the fan-out and, when none of its last max_concurrency items is
    still open, mark it COMPLETED and answer every item's result in order; else None. Two last items
    ending together take turns on the lock, and the second counts after the first committed, so
    exactly one of them ends the fan-out."""
    fan = (
        await conn.execute(
            select(fan_outs.c.state, fan_outs.c.total, fan_outs.c.max_concurrency)
            .where(fan_outs.c.id == fan_out_id)
            .with_for_update()
        )
    ).one_or_none()
    if fan is None or fan.state != FanOutState.RUNNING:
        return None
    still_open = await conn.scalar(
        select(func.count())
        .select_from(tasks)
        .where(
            tasks.c.fan_out_id == fan_out_id,
            tasks.c.item_index >= fan.total - fan.max_concurrency,
            one_of(tasks.c.state, OPEN_TASK_STATES),
        )
    )
    if still_open:
        return None
    await conn.execute(
        update(fan_outs)
        .where(fan_outs.c.id == fan_out_id)
        .values(state=FanOutState.COMPLETED, ended_at=func.now())
    )
    gathered = (
        await conn.execute(
            select(
                func.jsonb_agg(aggregate_order_by(tasks.c.item_result, tasks.c.item_index)).label("results"),
                func.count().filter(tasks.c.state == TaskState.SKIPPED).label("skipped"),
            ).where(tasks.c.fan_out_id == fan_out_id)
        )
    ).one()
    return FanOutEnded(list(gathered.results), int(gathered.skipped))


async def cancel_of_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> None:
    """A cancelled instance's running fan-outs end CANCELED (their items are withdrawn with its tasks)."""
    await conn.execute(
        update(fan_outs)
        .where(fan_outs.c.instance_id == instance_id, fan_outs.c.state == FanOutState.RUNNING)
        .values(state=FanOutState.CANCELED, ended_at=func.now())
    )


@dataclass(frozen=True, slots=True)
class FanOutProgress:
    node_id: str
    state: str
    total: int
    done: int
    running: int
    failed: int
    skipped: int


_RUNNING = (
    TaskState.READY,
    TaskState.LEASED,
    TaskState.WAITING,
    TaskState.AWAITING_APPROVAL,
    TaskState.PARKED,
)


async def progress_of_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> list[FanOutProgress]:
    """Each fan-out of the instance with its items counted by state, oldest first (GetInstance: one
    instance's read, so counting its items is fine here)."""

    def counted(states: tuple[TaskState, ...]) -> Any:
        return func.count().filter(one_of(tasks.c.state, states))

    query = (
        select(
            fan_outs.c.node_id,
            fan_outs.c.state,
            fan_outs.c.total,
            counted((TaskState.COMPLETED, TaskState.SKIPPED)).label("done"),
            counted(_RUNNING).label("running"),
            counted((TaskState.INCIDENT,)).label("failed"),
            counted((TaskState.SKIPPED,)).label("skipped"),
        )
        .select_from(fan_outs.outerjoin(tasks, tasks.c.fan_out_id == fan_outs.c.id))
        .where(fan_outs.c.instance_id == instance_id)
        .group_by(fan_outs.c.id)
        .order_by(fan_outs.c.created_at, fan_outs.c.id)
    )
    return [
        FanOutProgress(r.node_id, r.state, r.total, r.done, r.running, r.failed, r.skipped)
        for r in await conn.execute(query)
    ]


__all__ = [
    "FanOutEnded",
    "FanOutProgress",
    "FinishedItem",
    "cancel_of_instance",
    "end_if_done",
    "finish_item",
    "progress_of_instance",
]
