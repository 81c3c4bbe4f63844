"""The items of a `for_each` node: each a task of its own, found by its fan-out and index.

At most max_concurrency items are open at once, as in Camunda 8: the move into the node offers the
first max_concurrency, and each item's end offers the lowest-index item still PENDING, whichever item
ended (claimed with SKIP LOCKED, so two ends never offer one item and no end waits on another). No
row is written by every end. An end that found nothing left to offer may be the fan-out's last: it
asks, after its commit, whether any item is still open (a read of the few open items through their
own partial index), and only when none is does it take the fan-out row's lock to decide.
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

from .hand_written import Executor, HandWritten, as_many_as_given
from .history import HistoryRecord
from .states import OPEN_TASK_STATES, FanOutState, TaskKind, TaskState, is_, one_of, sql_list
from .tasks import TASK_CHANNEL

# The open states, as the partial index `tasks_fan_out_open` names them: a query that repeats its
# predicate reads the fan-out's open items only, not every ended one.
_OPEN = sql_list(OPEN_TASK_STATES)

# Hand-written: every item's end runs it, and the ends that arrive together share it (a group commit).
# Each ends its item (under its lease when `guard_worker` is set, else only while it is in
# `from_state`), keeps what it gave, and writes the item's history; each fan-out's ends in the batch
# offer as many of its PENDING items, lowest index first, as there are ends (fewer when fewer are
# left, or when a concurrent end holds one: it offers that one). Nothing of an end unless its item
# ended (its `n` is then missing from the result). Answers each ended item's place and whether its
# fan-out had nothing left to offer it (then the end may be the fan-out's last).
FINISH_ITEMS = HandWritten(
    f"""
    WITH item AS (
        SELECT * FROM jsonb_to_recordset(CAST(:items AS jsonb)) AS m(
            n integer, task_id uuid, state text, result jsonb, guard_worker text, guard_hash text,
            from_state text, history jsonb)
        {as_many_as_given(":items")}
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
        SELECT fan_out_id, count(*) AS ended, min(item_index) AS after FROM finished GROUP BY fan_out_id
    ),
    picked AS (
        -- Items are offered in index order, so a PENDING item comes after the items that ended: the
        -- scan starts past them instead of walking the dead index entries they left. Past the lowest
        -- of them: an end rolled back after locking an item leaves it PENDING behind one offered past
        -- it (by an end that skipped the lock), and only that end's own items, ending again, are sure
        -- to come before it, batched or not with higher ones.
        SELECT nx.id, fan.fan_out_id FROM fan CROSS JOIN LATERAL (
            SELECT p.id FROM tasks p
            WHERE p.fan_out_id = fan.fan_out_id AND p.item_index > fan.after
              AND p.state = '{TaskState.PENDING}' AND p.state IN {_OPEN}
            ORDER BY p.item_index
            LIMIT fan.ended
            FOR UPDATE SKIP LOCKED
        ) AS nx
    ),
    offered AS (
        UPDATE tasks nx
        SET state = CASE WHEN nx.kind = '{TaskKind.EXTERNAL}' THEN '{TaskState.READY}'
                         ELSE '{TaskState.WAITING}' END,
            due_at = now(), created_at = now()
        FROM picked
        WHERE nx.id = picked.id
        RETURNING nx.topic, nx.kind, picked.fan_out_id
    ),
    short AS (
        SELECT fan.fan_out_id FROM fan
        WHERE fan.ended > (SELECT count(*) FROM offered o WHERE o.fan_out_id = fan.fan_out_id)
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
    SELECT f.n, f.fan_out_id, f.item_index, f.fan_out_id IN (SELECT fan_out_id FROM short) AS may_be_last,
           (SELECT topics FROM notified) AS notified, (SELECT count(*) FROM written) AS lines
    FROM finished f
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
    # Its fan-out had no PENDING item left to offer: its end may be the fan-out's (`end_if_done`).
    may_be_last: bool


async def finish_items(conn: Executor, ends: list[ItemEnd]) -> list[FinishedItem | None]:
    """End items in one statement and offer as many PENDING items in their place; per item, how it
    ended, or None when its lease (or `from_state`) no longer held, and then nothing of it was written."""
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
        row["n"]: FinishedItem(row["fan_out_id"], row["item_index"], bool(row["may_be_last"])) for row in rows
    }
    return [finished.get(n) for n in range(len(ends))]


@dataclass(frozen=True, slots=True)
class FanOutEnded:
    # Each item's result in the list's order: null for a skipped item.
    results: list[Any]
    skipped: int


async def open_items(conn: Executor, fan_out_id: uuid.UUID) -> int:
    """How many of the fan-out's items are open (offered, running, held or PENDING), read without a
    lock. An end that committed before reading sees every end committed before it, and the last end to
    commit sees none open: only an end that reads 0 needs `end_if_done` (which counts again under the
    lock). With nothing left to offer, at most max_concurrency items are open: a short read."""
    rows = await OPEN_ITEMS.fetch(conn, {"fan_out_id": str(fan_out_id)})
    return int(rows[0]["open"]) if rows else 0


OPEN_ITEMS = HandWritten(
    f"""
    SELECT count(*) AS open FROM tasks t
    WHERE t.fan_out_id = CAST(:fan_out_id AS uuid) AND t.state IN {_OPEN}
    """
)


async def end_if_done(conn: AsyncConnection, fan_out_id: uuid.UUID) -> FanOutEnded | None:
    """In the caller's transaction: lock the fan-out and, when none of its items is still open, mark it
    COMPLETED and answer every item's result in order; else None. Two last items
    ending together take turns on the lock, and the second counts after the first committed, so
    exactly one of them ends the fan-out."""
    fan = (
        await conn.execute(select(fan_outs.c.state).where(fan_outs.c.id == fan_out_id).with_for_update())
    ).one_or_none()
    if fan is None or fan.state != FanOutState.RUNNING:
        return None
    still_open = await open_items(conn, fan_out_id)
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
    """Running fan-outs none of whose items is open: their end was not decided (each is checked on its
    open items, through the running fan-outs' index and the open items' one)."""
    any_open = (
        select(tasks.c.id)
        .where(tasks.c.fan_out_id == fan_outs.c.id, one_of(tasks.c.state, OPEN_TASK_STATES))
        .exists()
    )
    query = (
        select(fan_outs.c.id, fan_outs.c.instance_id, fan_outs.c.node_id, instances.c.definition_id)
        .join(instances, instances.c.id == fan_outs.c.instance_id)
        .where(is_(fan_outs.c.state, FanOutState.RUNNING), ~any_open)
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
    "open_items",
    "progress_of_instance",
    "unended",
]
