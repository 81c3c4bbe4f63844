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
from abada_engine.db.schema import fan_outs, instances, tasks

from .hand_written import Executor, HandWritten
from .history import HistoryRecord
from .states import OPEN_TASK_STATES, FanOutState, TaskKind, TaskState, is_, one_of, sql_list
from .tasks import TASK_CHANNEL

# Hand-written: every item's end runs it, and the ends that arrive together share it (a group commit).
# Each ends its item (under its lease when `guard_worker` is set, else only while it is in
# `from_state`), keeps what it gave, offers the item max_concurrency places later and writes the
# item's history; nothing of an end unless its item ended (its `n` is then missing from the result).
# Answers each item's place and whether it is among the last max_concurrency (whose end may be the
# fan-out's). No two ends of one batch touch one row: an item's successor is PENDING, never ending.
FINISH_ITEMS = HandWritten(
    f"""
    WITH item AS (
        SELECT * FROM jsonb_to_recordset(CAST(:items AS jsonb)) AS m(
            n integer, task_id uuid, state text, result jsonb, guard_worker text, guard_hash text,
            from_state text, history jsonb)
    ),
    finished AS (
        UPDATE tasks t
        SET state = m.state, completed_at = now(), lease_token_hash = NULL, item_result = m.result
        FROM item m
        WHERE t.id = m.task_id AND t.fan_out_id IS NOT NULL
          AND (m.guard_worker IS NULL OR (
               t.state = '{TaskState.LEASED}' AND t.lease_owner = m.guard_worker
               AND t.lease_token_hash = decode(m.guard_hash, 'hex') AND t.lease_expires_at > now()))
          AND (m.from_state IS NULL OR t.state = m.from_state)
        RETURNING m.n, t.id AS task_id, t.instance_id, t.fan_out_id, t.item_index
    ),
    fan AS (
        SELECT f.n, f.fan_out_id, f.item_index, o.total, o.max_concurrency
        FROM finished f JOIN fan_outs o ON o.id = f.fan_out_id
    ),
    offered AS (
        UPDATE tasks nx
        SET state = CASE WHEN nx.kind = '{TaskKind.EXTERNAL}' THEN '{TaskState.READY}'
                         ELSE '{TaskState.WAITING}' END,
            due_at = now(), created_at = now()
        FROM fan
        WHERE nx.fan_out_id = fan.fan_out_id AND nx.item_index = fan.item_index + fan.max_concurrency
          AND nx.state = '{TaskState.PENDING}'
        RETURNING nx.topic, nx.kind
    ),
    written AS (
        INSERT INTO history (instance_id, type, node_id, task_id, data)
        SELECT f.instance_id, h.item ->> 'type', h.item ->> 'node_id', f.task_id,
               (h.item -> 'data') || jsonb_build_object('item_index', f.item_index)
        FROM finished f JOIN item m ON m.n = f.n,
             jsonb_array_elements(m.history) WITH ORDINALITY AS h(item, k)
        ORDER BY f.n, h.k
        RETURNING id
    ),
    notified AS (
        SELECT count(pg_notify(CAST(:channel AS text), topic)) AS topics
        FROM (SELECT DISTINCT topic FROM offered WHERE topic IS NOT NULL AND kind = '{TaskKind.EXTERNAL}') AS o
    )
    SELECT fan.n, fan.fan_out_id, fan.item_index, fan.item_index + fan.max_concurrency >= fan.total AS last_round,
           (SELECT topics FROM notified) AS notified, (SELECT count(*) FROM written) AS lines
    FROM fan
    """
)


@dataclass(frozen=True, slots=True)
class ItemEnd:
    """An item to end: COMPLETED or SKIPPED, keeping `result`, with its history lines; under the lease of
    `guard_worker` (`guard_hash`), or only while in `from_state`."""

    task_id: uuid.UUID
    state: TaskState
    result: Any
    history: list[HistoryRecord]
    guard_worker: str | None = None
    guard_hash: bytes | None = None
    from_state: TaskState | None = None


@dataclass(frozen=True, slots=True)
class FinishedItem:
    fan_out_id: uuid.UUID
    item_index: int
    # Among the last max_concurrency items: its end may be the fan-out's (`end_if_done`).
    last_round: bool


async def finish_items(conn: Executor, ends: list[ItemEnd]) -> list[FinishedItem | None]:
    """End items in one statement and offer the next of each lane; per item, how it ended, or None when
    its lease (or `from_state`) no longer held, and then nothing of it was written."""
    items = [
        {
            "n": n,
            "task_id": str(end.task_id),
            "state": end.state.value,
            "result": end.result,
            "guard_worker": end.guard_worker,
            "guard_hash": end.guard_hash.hex() if end.guard_hash is not None else None,
            "from_state": end.from_state.value if end.from_state is not None else None,
            "history": [{"type": r.type, "node_id": r.node_id, "data": r.data} for r in end.history],
        }
        for n, end in enumerate(ends)
    ]
    rows = await FINISH_ITEMS.fetch(conn, {"items": dumps(items), "channel": TASK_CHANNEL})
    finished = {
        row["n"]: FinishedItem(row["fan_out_id"], row["item_index"], bool(row["last_round"])) for row in rows
    }
    return [finished.get(n) for n in range(len(ends))]


@dataclass(frozen=True, slots=True)
class FanOutEnded:
    # Each item's result in the list's order: null for a skipped item.
    results: list[Any]
    skipped: int


async def tail_open(conn: Executor, fan_out_id: uuid.UUID) -> int:
    """How many of the fan-out's last max_concurrency items are open, read without a lock. An end that
    committed before reading sees every end committed before it, and the last end to commit sees none
    open: only an end that reads 0 needs `end_if_done` (which counts again under the lock)."""
    rows = await TAIL_OPEN.fetch(conn, {"fan_out_id": str(fan_out_id)})
    return int(rows[0]["open"]) if rows else 0


TAIL_OPEN = HandWritten(
    f"""
    SELECT count(t.id) AS open FROM fan_outs f
    JOIN tasks t ON t.fan_out_id = f.id AND t.item_index >= f.total - f.max_concurrency
    WHERE f.id = CAST(:fan_out_id AS uuid) AND t.state IN {sql_list(OPEN_TASK_STATES)}
    """
)


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


@dataclass(frozen=True, slots=True)
class Unended:
    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    definition_id: uuid.UUID


async def unended(conn: AsyncConnection, limit: int = 100) -> list[Unended]:
    """Running fan-outs none of whose last max_concurrency items is open: their end was not decided
    (each is checked on those few items, through the running fan-outs' own index)."""
    tail_open = (
        select(tasks.c.id)
        .where(
            tasks.c.fan_out_id == fan_outs.c.id,
            tasks.c.item_index >= fan_outs.c.total - fan_outs.c.max_concurrency,
            one_of(tasks.c.state, OPEN_TASK_STATES),
        )
        .exists()
    )
    query = (
        select(fan_outs.c.id, fan_outs.c.instance_id, fan_outs.c.node_id, instances.c.definition_id)
        .join(instances, instances.c.id == fan_outs.c.instance_id)
        .where(is_(fan_outs.c.state, FanOutState.RUNNING), ~tail_open)
        .limit(limit)
    )
    return [Unended(r.id, r.instance_id, r.node_id, r.definition_id) for r in await conn.execute(query)]


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
    "ItemEnd",
    "cancel_of_instance",
    "end_if_done",
    "finish_items",
    "progress_of_instance",
    "tail_open",
    "unended",
]
