"""Moving a token in one statement: finish the task it leaves, create the next task or incident, move
the instance, and write the history, all or nothing."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.database import dumps
from abada_engine.db.schema import instances, start_requests

from .hand_written import Executor, HandWritten, as_many_as_given
from .history import HistoryRecord
from .messages import RECEIVE_CHANNEL
from .states import (
    OPEN_TASK_STATES,
    FanOutState,
    IncidentState,
    InstanceState,
    TaskKind,
    TaskState,
    TimerKind,
    is_,
    sql_list,
)
from .tasks import TASK_CHANNEL
from .timers import TIMER_CHANNEL


@dataclass(frozen=True, slots=True)
class NewTimer:
    """A due time of the new task: `delay_seconds` after the move (the database's clock), or at `at`."""

    kind: TimerKind
    delay_seconds: float | None
    at: datetime | None


@dataclass(frozen=True, slots=True)
class NewTask:
    id: uuid.UUID
    node_id: str
    kind: TaskKind
    topic: str | None
    payload: dict[str, Any]
    retries: int
    timers: tuple[NewTimer, ...] = ()


@dataclass(frozen=True, slots=True)
class NewFanOut:
    """A `for_each` node's items: a task each (`item_ids[i]` with `payloads[i]`), the first
    `max_concurrency` offered at once and the others PENDING until an earlier item ends."""

    id: uuid.UUID
    node_id: str
    kind: TaskKind
    topic: str | None
    retries: int
    max_concurrency: int
    item_ids: tuple[uuid.UUID, ...]
    payloads: tuple[dict[str, Any], ...]


@dataclass(frozen=True, slots=True)
class NewIncident:
    id: uuid.UUID
    node_id: str
    type: str
    message: str
    details: dict[str, Any]
    task_id: uuid.UUID | None


@dataclass(frozen=True, slots=True)
class LeaseGuard:
    """Move only if this worker still holds the live lease (checked inside the statement)."""

    worker_id: str
    token_hash: bytes
    # The instance row's xmin the decision was made on; None skips the check.
    instance_xmin: str | None = None


@dataclass(frozen=True, slots=True)
class TokenMove:
    instance_id: uuid.UUID
    current_node_id: str
    completed: bool
    # The instance's new variable map, or None when it did not change.
    variables: dict[str, Any] | None
    history: list[HistoryRecord] = field(default_factory=list)
    new_task: NewTask | None = None
    new_incident: NewIncident | None = None
    # A task this move ends, in `finished_state` (COMPLETED, or INCIDENT when an incident holds it).
    finished_task_id: uuid.UUID | None = None
    finished_state: TaskState = TaskState.COMPLETED
    guard: LeaseGuard | None = None
    # Move only if the finished task is still open (a due time that fired after the task moved on).
    only_if_open: bool = False
    # A `parallel` forked: a move per branch (its task or incident and history), written with this one
    # and only if it is (`move_token`, `start_instances`: in the caller's transaction, never grouped).
    branches: tuple[TokenMove, ...] = ()
    # A join on `any` let this token through: the other branches are withdrawn before it is written.
    withdraws_other_branches: bool = False
    # The token rests at a `for_each` node: its items, written in the same statement (instead of a task).
    fan_out: NewFanOut | None = None


# A new due time: at the given time, or the given seconds after now (the database's clock, which every
# replica shares; an engine's own clock may be off).
_DUE_AT = (
    "COALESCE(CAST(t.item ->> 'at' AS timestamptz), "
    "now() + CAST(t.item ->> 'delay_seconds' AS double precision) * interval '1 second')"
)
# Tells every replica the earliest of the new due times (epoch seconds), so one sleeping until a later
# one wakes in time (runtime/background/timer_clock.py). Only when there is one.
_NOTIFY_TIMERS = (
    f"SELECT count(pg_notify('{TIMER_CHANNEL}', CAST(EXTRACT(EPOCH FROM first) AS text))) AS due "
    "FROM (SELECT min(due_at) AS first FROM new_timers) AS earliest WHERE first IS NOT NULL"
)

# A new receive may be matched by a message buffered before it: tells the replicas to look.
_NOTIFY_RECEIVES = (
    f"SELECT count(pg_notify('{RECEIVE_CHANNEL}', '')) AS sent FROM "
    f"(SELECT 1 FROM new_task WHERE kind = '{TaskKind.RECEIVE}' LIMIT 1) AS created"
)


# The columns `_created` reads, as `_created_by` fills them: both statements' records declare them.
_CREATED_COLUMNS = (
    "task_id uuid, task_node text, task_kind text, task_topic text, task_state text, task_payload jsonb, "
    "task_retries integer, incident_id uuid, incident_task uuid, incident_node text, incident_type text, "
    "incident_message text, incident_details jsonb, timers jsonb, fan_out_id uuid, fan_out_node text, "
    "fan_out_kind text, fan_out_topic text, fan_out_state text, fan_out_retries integer, "
    "fan_out_concurrency integer, fan_out_items jsonb"
)


def _created(rows: str) -> str:
    """The CTEs writing what a move or a start creates, from `rows` (the moves that proceed, or the
    starts whose instance was written, aliased `p`): the next task and its timers, or a `for_each`
    node's fan-out and its items, or an incident. The first max_concurrency items of a fan-out are
    offered; the others wait PENDING."""
    return f"""
    new_task AS (
        INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at,
                           created_at)
        SELECT p.task_id, p.instance_id, p.task_node, p.task_kind, p.task_topic, p.task_state, p.task_payload, 0,
               p.task_retries, now(), now()
        FROM {rows} WHERE p.task_id IS NOT NULL
        ORDER BY p.n
        RETURNING topic, kind
    ),
    receives_notified AS ({_NOTIFY_RECEIVES}),
    new_timers AS (
        INSERT INTO timers (instance_id, task_id, node_id, kind, due_at)
        SELECT p.instance_id, p.task_id, p.task_node, t.item ->> 'kind', {_DUE_AT}
        FROM {rows}, jsonb_array_elements(p.timers) AS t(item)
        WHERE p.task_id IS NOT NULL
        RETURNING due_at
    ),
    timers_notified AS ({_NOTIFY_TIMERS}),
    new_fan_out AS (
        INSERT INTO fan_outs (id, instance_id, node_id, total, max_concurrency, state, created_at)
        SELECT p.fan_out_id, p.instance_id, p.fan_out_node, jsonb_array_length(p.fan_out_items),
               p.fan_out_concurrency, '{FanOutState.RUNNING}', now()
        FROM {rows} WHERE p.fan_out_id IS NOT NULL
        RETURNING id
    ),
    new_items AS (
        INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at,
                           created_at, fan_out_id, item_index)
        SELECT CAST(e.item ->> 'id' AS uuid), p.instance_id, p.fan_out_node, p.fan_out_kind, p.fan_out_topic,
               CASE WHEN e.k <= p.fan_out_concurrency THEN p.fan_out_state ELSE '{TaskState.PENDING}' END,
               e.item -> 'payload', 0, p.fan_out_retries, now(), now(), p.fan_out_id, e.k - 1
        FROM {rows}, jsonb_array_elements(p.fan_out_items) WITH ORDINALITY AS e(item, k)
        WHERE p.fan_out_id IS NOT NULL
        ORDER BY p.n, e.k
        RETURNING topic
    ),
    new_incident AS (
        INSERT INTO incidents (id, instance_id, task_id, node_id, type, message, details, state, created_at)
        SELECT p.incident_id, p.instance_id, p.incident_task, p.incident_node, p.incident_type, p.incident_message,
               p.incident_details, '{IncidentState.OPEN}', now()
        FROM {rows} WHERE p.incident_id IS NOT NULL
        RETURNING id
    ),"""


# Tells the fetchers of each topic a new task was created (a new task's, or a fan-out's items').
_NOTIFY_TOPICS = """
    notified AS (
        SELECT count(pg_notify(CAST(:channel AS text), topic)) AS topics
        FROM (SELECT topic FROM new_task UNION SELECT topic FROM new_items) AS created
        WHERE topic IS NOT NULL
    )"""


# Hand-written: every Complete runs it, and every other move of a token. One statement, so one round trip
# and no transaction to hold open. Each move finishes the task it leaves, creates the next task or
# incident, moves the instance and writes the history; with a lease guard, nothing of that move is
# written unless the lease is live, and its `n` is missing from the result. The Completes that arrive
# together share it (a group commit, see runtime/completion.py). At most one move per instance (and so
# per task): two moves of one instance in one statement would both pass the instance's xmin guard.
# The guard reads the instance by its primary key alone: with `state = 'ACTIVE'` beside the id, the
# planner would scan the partial index `instances_active` for the id, past every finished instance's
# dead entry since the last vacuum.
MOVE_TOKENS = HandWritten(
    f"""
    WITH move AS (
        SELECT * FROM jsonb_to_recordset(CAST(:moves AS jsonb)) AS m(
            n integer, instance_id uuid, guard_worker text, guard_hash text, guard_xmin text,
            finished_task_id uuid, finished_state text, current_node text, variables jsonb, completed boolean,
            history jsonb, only_if_open boolean, {_CREATED_COLUMNS})
        {as_many_as_given(":moves")}
    ),
    finished AS (
        UPDATE tasks t SET state = m.finished_state, completed_at = now(), lease_token_hash = NULL
        FROM move m
        WHERE t.id = m.finished_task_id
          AND (m.only_if_open IS NOT TRUE OR t.state IN {sql_list(OPEN_TASK_STATES)})
          AND (m.guard_worker IS NULL OR (
               t.state = '{TaskState.LEASED}' AND t.lease_owner = m.guard_worker
               AND t.lease_token_hash = decode(m.guard_hash, 'hex') AND t.lease_expires_at > now()
               AND (SELECT i.state = '{InstanceState.ACTIVE}'
                           AND (m.guard_xmin IS NULL OR i.xmin::text = m.guard_xmin)
                    FROM instances i WHERE i.id = m.instance_id)))
        RETURNING m.n
    ),
    proceed AS (
        SELECT m.* FROM move m WHERE m.finished_task_id IS NULL OR m.n IN (SELECT n FROM finished)
    ),
{_created("proceed p")}
    moved AS (
        UPDATE instances i
        SET current_node_id = p.current_node,
            variables = CASE WHEN p.variables IS NULL THEN i.variables ELSE i.variables || p.variables END,
            state = CASE WHEN p.completed THEN '{InstanceState.COMPLETED}' ELSE i.state END,
            ended_at = CASE WHEN p.completed THEN now() ELSE i.ended_at END
        FROM proceed p WHERE i.id = p.instance_id
        RETURNING i.id
    ),
    written AS (
        INSERT INTO history (instance_id, type, node_id, task_id, data)
        SELECT p.instance_id, h.item ->> 'type', h.item ->> 'node_id', CAST(h.item ->> 'task_id' AS uuid),
               h.item -> 'data'
        FROM proceed p, jsonb_array_elements(p.history) WITH ORDINALITY AS h(item, k)
        ORDER BY p.n, h.k
        RETURNING id
    ),
{_NOTIFY_TOPICS}
    SELECT p.n, (SELECT topics FROM notified) AS notified, (SELECT due FROM timers_notified) AS due,
           (SELECT sent FROM receives_notified) AS receives
    FROM proceed p
    """
)


async def move_tokens(conn: Executor, moves: list[TokenMove]) -> list[bool]:
    """Write many moves in one statement, each under its own guard; per move, whether it was written.
    At most one move per instance (and so per task) in a call."""
    assert len({move.instance_id for move in moves}) == len(moves), "one move per instance"
    assert not any(move.branches for move in moves), "a fork is written in a transaction (move_token)"
    rows = await MOVE_TOKENS.fetch(
        conn, {"moves": dumps([_move_json(n, move) for n, move in enumerate(moves)]), "channel": TASK_CHANNEL}
    )
    written = {row["n"] for row in rows}
    return [n in written for n in range(len(moves))]


async def move_token(conn: Executor, move: TokenMove) -> bool:
    """Write one move; False if its guard refused it (then nothing was written). A move that forks
    writes its branches next: call it in a transaction then."""
    [written] = await move_tokens(conn, [replace(move, branches=())])
    if written and move.branches:
        await _write_branches(conn, move.branches)
    return written


async def _write_branches(conn: Executor, branches: tuple[TokenMove, ...]) -> None:
    """Each branch's task or incident and history, in one statement (none is guarded: the fork was)."""
    await MOVE_TOKENS.fetch(
        conn,
        {"moves": dumps([_move_json(n, move) for n, move in enumerate(branches)]), "channel": TASK_CHANNEL},
    )


def _move_json(n: int, move: TokenMove) -> dict[str, Any]:
    guard = move.guard
    return {
        "n": n,
        "instance_id": str(move.instance_id),
        "guard_worker": guard.worker_id if guard else None,
        "guard_hash": guard.token_hash.hex() if guard else None,
        "guard_xmin": guard.instance_xmin if guard else None,
        "finished_task_id": str(move.finished_task_id) if move.finished_task_id else None,
        "finished_state": move.finished_state.value,
        "only_if_open": move.only_if_open,
        **_created_by(move),
        "current_node": move.current_node_id,
        "variables": move.variables,
        "completed": move.completed,
        "history": _history_items(move.history),
    }


def _created_by(move: TokenMove) -> dict[str, Any]:
    """The task or incident a move creates, as the columns the statements take (JSON values as values)."""
    task, incident = move.new_task, move.new_incident
    return {
        "task_id": str(task.id) if task else None,
        "task_node": task.node_id if task else None,
        "task_kind": task.kind.value if task else None,
        "task_topic": task.topic if task else None,
        "task_state": (TaskState.READY if task.kind is TaskKind.EXTERNAL else TaskState.WAITING).value
        if task
        else None,
        "task_payload": task.payload if task else None,
        "task_retries": task.retries if task else 0,
        "incident_id": str(incident.id) if incident else None,
        "incident_node": incident.node_id if incident else None,
        "incident_task": str(incident.task_id) if incident and incident.task_id else None,
        "incident_type": incident.type if incident else None,
        "incident_message": incident.message if incident else None,
        "incident_details": incident.details if incident else None,
        "timers": [
            {
                "kind": timer.kind.value,
                "delay_seconds": timer.delay_seconds,
                "at": timer.at.isoformat() if timer.at else None,
            }
            for timer in (task.timers if task else ())
        ],
        **_fan_out_json(move.fan_out),
    }


def _fan_out_json(fan_out: NewFanOut | None) -> dict[str, Any]:
    if fan_out is None:
        return {"fan_out_id": None}
    first_state = TaskState.READY if fan_out.kind is TaskKind.EXTERNAL else TaskState.WAITING
    return {
        "fan_out_id": str(fan_out.id),
        "fan_out_node": fan_out.node_id,
        "fan_out_kind": fan_out.kind.value,
        "fan_out_topic": fan_out.topic,
        "fan_out_state": first_state.value,
        "fan_out_retries": fan_out.retries,
        "fan_out_concurrency": fan_out.max_concurrency,
        "fan_out_items": [
            {"id": str(item_id), "payload": payload}
            for item_id, payload in zip(fan_out.item_ids, fan_out.payloads, strict=True)
        ],
    }


def _history_items(records: list[HistoryRecord]) -> list[dict[str, Any]]:
    return [
        {
            "type": r.type,
            "node_id": r.node_id,
            "task_id": str(r.task_id) if r.task_id else None,
            "data": r.data,
        }
        for r in records
    ]


@dataclass(frozen=True, slots=True)
class NewInstance:
    id: uuid.UUID
    definition_id: uuid.UUID
    process_id: str
    version: int
    variables: dict[str, Any]
    business_key: str


# Hand-written: every StartInstance runs it. Each new instance is written where its first move left
# it, with that move's task or incident and history; the starts that arrive together share the one
# statement (a group commit: one round trip and one commit for all of them, see runtime/instances.py).
# A start with must_be_latest carries the version a replica believed latest without reading it: if a
# newer one exists by now (or the believed one is gone), nothing of that start is written and its id
# is missing from the result. Every insert below joins `instance`, so all of them skip it together.
START_INSTANCES = HandWritten(
    f"""
    WITH start AS (
        SELECT * FROM jsonb_to_recordset(CAST(:starts AS jsonb)) AS s(
            n integer, instance_id uuid, definition_id uuid, process_id text, version integer,
            completed boolean, variables jsonb, current_node text, business_key text, must_be_latest boolean,
            history jsonb, {_CREATED_COLUMNS})
    ),
    instance AS (
        INSERT INTO instances (id, definition_id, process_id, version, state, variables, current_node_id,
                               business_key, created_at, ended_at)
        SELECT s.instance_id, s.definition_id, s.process_id, s.version,
               CASE WHEN s.completed THEN '{InstanceState.COMPLETED}' ELSE '{InstanceState.ACTIVE}' END,
               s.variables, s.current_node, s.business_key, now(), CASE WHEN s.completed THEN now() END
        FROM start s
        WHERE NOT s.must_be_latest
           OR (EXISTS (SELECT 1 FROM definitions AS believed WHERE believed.id = s.definition_id)
               AND NOT EXISTS (SELECT 1 FROM definitions AS newer
                               WHERE newer.process_id = s.process_id AND newer.version > s.version))
        ORDER BY s.n
        RETURNING id, created_at
    ),
{_created("start p JOIN instance i ON i.id = p.instance_id")}
    written AS (
        INSERT INTO history (instance_id, type, node_id, task_id, data)
        SELECT s.instance_id, h.item ->> 'type', h.item ->> 'node_id', CAST(h.item ->> 'task_id' AS uuid),
               h.item -> 'data'
        FROM start s JOIN instance i ON i.id = s.instance_id,
             jsonb_array_elements(s.history) WITH ORDINALITY AS h(item, n)
        ORDER BY s.n, h.n
        RETURNING id
    ),
{_NOTIFY_TOPICS}
    SELECT i.id, i.created_at, (SELECT topics FROM notified) AS notified,
           (SELECT due FROM timers_notified) AS due,
           (SELECT sent FROM receives_notified) AS receives
    FROM instance i
    """
)


@dataclass(frozen=True, slots=True)
class StartToWrite:
    """A new instance already moved by `first_move` (which carries no guard and finishes no task)."""

    instance: NewInstance
    first_move: TokenMove
    must_be_latest: bool = False


def _start_json(n: int, start: StartToWrite) -> dict[str, Any]:
    instance, move = start.instance, start.first_move
    return {
        "n": n,
        "instance_id": str(instance.id),
        "definition_id": str(instance.definition_id),
        "process_id": instance.process_id,
        "version": instance.version,
        "completed": move.completed,
        "variables": instance.variables,
        "current_node": move.current_node_id,
        "business_key": instance.business_key,
        "must_be_latest": start.must_be_latest,
        **_created_by(move),
        "history": _history_items(move.history),
    }


async def start_instances(conn: Executor, starts: list[StartToWrite]) -> list[datetime | None]:
    """Write new instances in one statement: when each was created, or None for a start whose
    `must_be_latest` no longer held (nothing of it written)."""
    rows = await START_INSTANCES.fetch(
        conn,
        {"starts": dumps([_start_json(n, start) for n, start in enumerate(starts)]), "channel": TASK_CHANNEL},
    )
    created = {str(row["id"]): row["created_at"] for row in rows}
    forked = tuple(
        b for start in starts if str(start.instance.id) in created for b in start.first_move.branches
    )
    if forked:
        await _write_branches(conn, forked)
    return [created.get(str(start.instance.id)) for start in starts]


# A start's request id is remembered this long: the same start sent again within it answers the first.
START_REQUEST_MEMORY = timedelta(days=1)


# The first key of the transaction locks that keep a unique business key's check and write together
# (the second is the key's hash); the number is this engine's own.
_UNIQUE_KEY_LOCKS = 0x0ABADA02


@dataclass(frozen=True, slots=True)
class StartOnce:
    """How a start that must happen once went: exactly one field is set, or none when a newer version
    was deployed meanwhile (as `start_instances` answers None)."""

    created_at: datetime | None = None
    # The request id was seen within a day: the instance its first start created.
    started_before: uuid.UUID | None = None
    # The business key is held by this active instance of the process.
    key_held_by: uuid.UUID | None = None


async def start_instance_once(
    conn: AsyncConnection, start: StartToWrite, request_id: str, unique_business_key: bool
) -> StartOnce:
    """Start one instance in `conn`'s transaction, unless its `request_id` (when set) was seen within
    `START_REQUEST_MEMORY`, or, with `unique_business_key`, an active instance of the process holds
    its business key.

    The request id is claimed first: a concurrent start with the same id waits on the claim and then
    reads the winner's instance. Starts with one unique key take turns on a transaction lock of that
    key, so the check and the write are one step. When the instance is not written, the caller rolls
    back, and the claim goes with it."""
    instance = start.instance
    if request_id:
        await conn.execute(
            delete(start_requests).where(
                start_requests.c.request_id == request_id,
                start_requests.c.created_at < func.now() - START_REQUEST_MEMORY,
            )
        )
        claimed = await conn.execute(
            pg_insert(start_requests)
            .values(request_id=request_id, instance_id=instance.id, created_at=func.now())
            .on_conflict_do_nothing()
            .returning(start_requests.c.request_id)
        )
        if claimed.first() is None:
            earlier = await conn.scalar(
                select(start_requests.c.instance_id).where(start_requests.c.request_id == request_id)
            )
            return StartOnce(started_before=earlier)
    if unique_business_key:
        # A process id has no "/" (it is an identifier), so the pair reads back one way.
        key = f"{instance.process_id}/{instance.business_key}"
        await conn.execute(select(func.pg_advisory_xact_lock(_UNIQUE_KEY_LOCKS, func.hashtext(key))))
        holder = await conn.scalar(
            select(instances.c.id)
            .where(
                instances.c.business_key == instance.business_key,
                instances.c.process_id == instance.process_id,
                is_(instances.c.state, InstanceState.ACTIVE),
            )
            .limit(1)
        )
        if holder is not None:
            return StartOnce(key_held_by=holder)
    (created_at,) = await start_instances(conn, [start])
    return StartOnce(created_at=created_at)
