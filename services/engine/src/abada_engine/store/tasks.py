"""The task queue: leasing due tasks, extending and checking leases, and every other task transition."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnClause, Integer, and_, bindparam, extract, func, literal_column, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import instances, journal_steps, tasks

from . import keyset
from .hand_written import Executor, HandWritten, typed
from .states import (
    FETCHABLE,
    OPEN_EXTERNAL_STATES,
    OPEN_TASK_STATES,
    DependencyState,
    StepKind,
    StepState,
    TaskKind,
    TaskState,
    is_,
    one_of,
    sql_list,
)

# PostgreSQL NOTIFY channel on which every transaction that makes a task fetchable names its topic.
TASK_CHANNEL = "abada_tasks"

_MILLISECOND: ColumnClause[Any] = literal_column("interval '1 millisecond'")


@dataclass(slots=True)
class LockedRow:
    """A task just leased to a fetcher, with what its instance looked like at that moment."""

    id: uuid.UUID
    n: int  # which of the offered lease tokens this task took (1-based)
    prior_state: str  # LEASED when a lease ran out and the task is taken over
    instance_id: uuid.UUID
    node_id: str
    topic: str
    payload: dict[str, Any]
    attempt: int
    retries_left: int
    lease_expires_at: datetime
    definition_id: uuid.UUID
    process_id: str
    instance_variables: dict[str, Any]
    # The instance row's version (PostgreSQL xmin): a write guarded by it fails if anything changed it.
    instance_xmin: str
    business_key: str
    # The instance was started by a call activity: its end moves its parent (runtime/calls.py).
    called: bool


@dataclass(slots=True)
class LeaseRow:
    """A task's lease and its instance, as read to check that a caller holds the lease."""

    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    state: str
    attempt: int
    retries_left: int
    lease_owner: str | None
    lease_token_hash: bytes | None
    lease_expires_at: datetime | None
    live: bool | None
    definition_id: uuid.UUID
    variables: dict[str, Any]
    instance_state: str
    instance_xmin: str | None
    # The instance was started by a call activity: its end moves its parent (runtime/calls.py).
    called: bool


# The instance's variables, as a lease is handed out and checked with them (a Complete decides the
# token's move on them), except for an item of a `for_each`: its end writes only its own rows, and the
# instance's variables hold the whole list it iterates, which every item's fetch and Complete would
# otherwise read and decode again (a list of 10,000 lines, 10,000 times).
LEASED_INSTANCE_VARIABLES = "CASE WHEN t.fan_out_id IS NULL THEN i.variables ELSE '{}'::jsonb END"

# Hand-written: every fetch runs it. One statement picks due tasks with SKIP LOCKED (fetchers never
# wait on each other), leases each with its own token hash and returns the instance alongside.
# Each topic is picked in its own LATERAL scan so the `tasks_fetchable (topic, due_at)` index yields
# rows already in due order and the scan stops after `max_tasks` unlocked ones; a join of the topics
# with the tasks then ordered by due_at would read and sort every due task of the topic instead
# (3x slower FetchAndLock with 10,000 tasks in flight). Rows a topic locked beyond the overall limit
# are let go when the statement ends.
LEASE_DUE = HandWritten(
    f"""
    WITH subscription AS (
        SELECT * FROM unnest(CAST(:topics AS text[]), CAST(:lease_ms AS bigint[])) AS s(topic, lease_ms)
    ),
    picked AS (
        SELECT due.id, s.lease_ms, due.state AS prior_state
        FROM subscription s
        CROSS JOIN LATERAL (
            SELECT t.id, t.state, t.due_at FROM tasks t
            WHERE t.topic = s.topic AND t.state IN {sql_list(FETCHABLE)} AND t.due_at <= now()
              AND (t.state <> '{TaskState.LEASED}' OR CAST(:takeovers AS boolean))
            ORDER BY t.due_at
            LIMIT CAST(:max_tasks AS integer)
            FOR UPDATE SKIP LOCKED
        ) due
        ORDER BY due.due_at
        LIMIT CAST(:max_tasks AS integer)
    ),
    numbered AS (SELECT picked.*, row_number() OVER () AS n FROM picked)
    UPDATE tasks t
    SET state = '{TaskState.LEASED}',
        attempt = t.attempt + 1,
        lease_owner = CAST(:worker_id AS text),
        lease_token_hash = token.hash,
        lease_expires_at = now() + numbered.lease_ms * interval '1 millisecond',
        due_at = now() + numbered.lease_ms * interval '1 millisecond'
    FROM numbered, unnest(CAST(:hashes AS bytea[])) WITH ORDINALITY AS token(hash, n), instances i
    WHERE t.id = numbered.id AND token.n = numbered.n AND i.id = t.instance_id
    RETURNING t.id, numbered.n, numbered.prior_state, t.instance_id, t.node_id, t.topic, t.payload, t.attempt,
              t.retries_left, t.lease_expires_at, i.definition_id, i.process_id,
              {LEASED_INSTANCE_VARIABLES} AS instance_variables,
              i.xmin::text AS instance_xmin, i.business_key, i.parent_task_id IS NOT NULL AS called
    """
)


async def lease_due(
    conn: Executor,
    worker_id: str,
    topics: Sequence[str],
    lease_ms: Sequence[int],
    max_tasks: int,
    token_hashes: Sequence[bytes],
    takeovers: bool = True,
) -> list[LockedRow]:
    """Lease up to `max_tasks` due tasks of `topics`, the n-th taking `token_hashes[n-1]`; an expired
    lease is taken over only with `takeovers`."""
    rows = await LEASE_DUE.fetch(
        conn,
        {
            "topics": list(topics),
            "lease_ms": list(lease_ms),
            "max_tasks": max_tasks,
            "worker_id": worker_id,
            "hashes": list(token_hashes),
            "takeovers": takeovers,
        },
    )
    return [typed(LockedRow, row) for row in rows]


async def seconds_until_due(conn: AsyncConnection, topics: Sequence[str]) -> float | None:
    """How long until the next task of `topics` becomes fetchable (negative: already due), or None."""
    query = select(extract("epoch", func.min(tasks.c.due_at) - func.now())).where(
        tasks.c.topic.in_(list(topics)), one_of(tasks.c.state, FETCHABLE)
    )
    due_in = (await conn.execute(query)).scalar()
    return None if due_in is None else float(due_in)


# Hand-written: every lease check (Complete's careful path, Fail, ExtendLease, VerifyLease) runs it.
_READ_LEASE_SQL = f"""
    SELECT t.id, t.instance_id, t.node_id, t.state, t.attempt, t.retries_left, t.lease_owner, t.lease_token_hash,
           t.lease_expires_at, t.lease_expires_at > now() AS live, i.definition_id,
           {LEASED_INSTANCE_VARIABLES} AS variables, i.state AS instance_state, i.xmin::text AS instance_xmin, i.parent_task_id IS NOT NULL AS called
    FROM tasks t JOIN instances i ON i.id = t.instance_id
    WHERE t.id = :id
"""
READ_LEASE = HandWritten(_READ_LEASE_SQL)
# The task's row only, which is what a takeover's fetch (SKIP LOCKED) meets: every item of a fan-out
# shares one instance, and its items' lease checks (an ExtendLease every few seconds from each) would
# queue on that row, each holding a pooled connection while it waits. What else the caller writes (an
# incident, a move) takes its rows as it writes them.
READ_LEASE_LOCKED = HandWritten(_READ_LEASE_SQL + " FOR UPDATE OF t")


async def read_lease(conn: Executor, task_id: uuid.UUID, lock: bool = False) -> LeaseRow | None:
    """The task's lease and instance; with `lock`, the task's row locked for the caller's transaction."""
    row = await (READ_LEASE_LOCKED if lock else READ_LEASE).fetchrow(conn, {"id": task_id})
    return typed(LeaseRow, row) if row is not None else None


async def extend_lease(conn: AsyncConnection, task_id: uuid.UUID, lease_ms: int) -> datetime:
    until = func.now() + bindparam("ms", lease_ms, Integer) * _MILLISECOND
    expires: datetime = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(lease_expires_at=until, due_at=until)
            .returning(tasks.c.lease_expires_at)
        )
    ).scalar_one()
    return expires


_NO_LEASE = {"lease_owner": None, "lease_token_hash": None, "lease_expires_at": None}
# A task done waiting out an outage: its next one starts a fresh outage budget.
_NO_OUTAGE = {"parked_on": None, "waiting_since": None, "outage_deadline": None, "outage_waits": 0}


async def release_for_retry(
    conn: AsyncConnection, task_id: uuid.UUID, backoff_ms: int, error: dict[str, Any]
) -> datetime:
    """A failed attempt with retries left: READY again after `backoff_ms`, one retry spent."""
    retry_at, topic = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(
                state=TaskState.READY,
                retries_left=tasks.c.retries_left - 1,
                last_error=bindparam("error", error, JSONB),
                due_at=func.now() + bindparam("ms", backoff_ms, Integer) * _MILLISECOND,
                **_NO_LEASE,
            )
            .returning(tasks.c.due_at, tasks.c.topic)
        )
    ).one()
    await announce_work(conn, topic)
    due: datetime = retry_at
    return due


async def release_unstarted(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """Its holder hands the task back before beginning: READY at once, no lease, no retry spent. The
    attempt number stays: the next holder's is the next one, so nothing of the two can be confused."""
    topic = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(state=TaskState.READY, due_at=func.now(), **_NO_LEASE)
            .returning(tasks.c.topic)
        )
    ).scalar_one()
    await announce_work(conn, topic)


async def attempt_has_steps(conn: AsyncConnection, task_id: uuid.UUID, attempt: int) -> bool:
    """Whether `attempt` journaled anything yet."""
    found = select(journal_steps.c.sequence).where(
        journal_steps.c.task_id == task_id, journal_steps.c.attempt == attempt
    )
    return bool((await conn.execute(select(found.exists()))).scalar())


async def hold_as_incident(
    conn: AsyncConnection,
    task_id: uuid.UUID,
    last_error: dict[str, Any] | None = None,
    give_back_attempt: bool = False,
) -> None:
    """An incident holds the task: no lease, not fetchable, until `offer_again`.

    `give_back_attempt` for a task locked but never handed out: the attempt the lock took is returned.
    """
    values: dict[str, Any] = {"state": TaskState.INCIDENT, "parked_on": None, **_NO_LEASE}
    if last_error is not None:
        values["last_error"] = bindparam("error", last_error, JSONB)
    if give_back_attempt:
        values["attempt"] = tasks.c.attempt - 1
    await conn.execute(update(tasks).where(tasks.c.id == task_id).values(**values))


async def offer_again(conn: AsyncConnection, task_id: uuid.UUID, retries_left: int | None = None) -> bool:
    """A task an incident held is fetchable again at once (with fresh retries if given); False if it
    is no longer held by an incident."""
    values: dict[str, Any] = {"state": TaskState.READY, "due_at": func.now(), **_NO_OUTAGE}
    if retries_left is not None:
        values["retries_left"] = retries_left
    return await _move_and_announce(conn, task_id, TaskState.INCIDENT, values)


async def _move_and_announce(
    conn: AsyncConnection, task_id: uuid.UUID, state: TaskState, values: dict[str, Any]
) -> bool:
    """Sets `values` on the task if it is in `state` and wakes its topic's fetchers; False if it was not."""
    topic = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id, tasks.c.state == state)
            .values(**values)
            .returning(tasks.c.topic)
        )
    ).scalar_one_or_none()
    if topic is None:
        return False
    await announce_work(conn, topic)
    return True


async def lock_state(conn: AsyncConnection, task_id: uuid.UUID, skip_locked: bool = False) -> str | None:
    """The task's state, its row locked for the caller's transaction (serialises decisions on one task);
    None if there is no such task, or with `skip_locked` if another transaction holds it."""
    return (
        await conn.execute(
            select(tasks.c.state).where(tasks.c.id == task_id).with_for_update(skip_locked=skip_locked)
        )
    ).scalar_one_or_none()


async def park_for_approval(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """The task waits for a person's approval: no lease (so no credential), not fetchable."""
    await conn.execute(
        update(tasks).where(tasks.c.id == task_id).values(state=TaskState.AWAITING_APPROVAL, **_NO_LEASE)
    )


async def offer_after_approval(conn: AsyncConnection, task_id: uuid.UUID) -> bool:
    """Every approval of a parked task is decided: fetchable again at once; False if it is not parked."""
    return await _move_and_announce(
        conn, task_id, TaskState.AWAITING_APPROVAL, {"state": TaskState.READY, "due_at": func.now()}
    )


async def park_again(conn: AsyncConnection, task_id: uuid.UUID) -> bool:
    """A task an incident held goes back to waiting for its approvals; False if no incident held it."""
    result = await conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id, tasks.c.state == TaskState.INCIDENT)
        .values(state=TaskState.AWAITING_APPROVAL)
    )
    return result.rowcount == 1


@dataclass(slots=True)
class OutageStreak:
    """How long a task has been waiting out outages, as of the database's `now`."""

    waiting_since: datetime
    outage_deadline: datetime
    # Temporary failures reported in a row, this one included.
    outage_waits: int
    now: datetime

    @property
    def budget_spent(self) -> bool:
        return self.outage_deadline <= self.now


async def note_outage(conn: AsyncConnection, task_id: uuid.UUID, budget_ms: int) -> OutageStreak:
    """The task met a temporary failure: its waiting streak goes on (or begins now, with `budget_ms`
    until its outage budget runs out)."""
    row = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(
                waiting_since=func.coalesce(tasks.c.waiting_since, func.now()),
                outage_deadline=func.coalesce(
                    tasks.c.outage_deadline,
                    func.now() + bindparam("budget", budget_ms, Integer) * _MILLISECOND,
                ),
                outage_waits=tasks.c.outage_waits + 1,
            )
            .returning(
                tasks.c.waiting_since, tasks.c.outage_deadline, tasks.c.outage_waits, func.now().label("now")
            )
        )
    ).one()
    return typed(OutageStreak, row._mapping)


async def end_outage(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """A call the task needed went through: its waiting streak is over."""
    await conn.execute(
        update(tasks).where(tasks.c.id == task_id, tasks.c.waiting_since.is_not(None)).values(**_NO_OUTAGE)
    )


async def park(conn: AsyncConnection, task_id: uuid.UUID, dependency: str) -> None:
    """Its holder met `dependency` down: PARKED (no lease, so no credential; not fetchable) until the
    dependency answers a probe."""
    await conn.execute(
        update(tasks)
        .where(tasks.c.id == task_id)
        .values(state=TaskState.PARKED, parked_on=dependency, **_NO_LEASE)
    )


async def wait_out(
    conn: AsyncConnection, task_id: uuid.UUID, delay_ms: int, error: dict[str, Any]
) -> datetime:
    """A temporary failure of a task without a circuit (a service task's): READY again after `delay_ms`,
    no retry spent."""
    due: datetime = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == task_id)
            .values(
                state=TaskState.READY,
                last_error=bindparam("error", error, JSONB),
                due_at=func.now() + bindparam("ms", delay_ms, Integer) * _MILLISECOND,
                **_NO_LEASE,
            )
            .returning(tasks.c.due_at)
        )
    ).scalar_one()
    return due


# Hand-written: the fetch runs it on the tasks it just locked, whenever some dependency is down. Each
# task is parked on the first of its dependencies that is not UP and of which it is not the probe,
# judged by the circuits as they are in the database now (a replica's view of them may lag). The
# attempt the lock took is given back: waiting for a dependency is no attempt.
# The circuits are read FOR SHARE: a call that got through closes its circuit and offers the parked
# tasks under the circuit's row lock, so this either waits for that and finds the circuit UP, or parks
# first and is offered with the rest. Read without the lock, a circuit closing beside it still looked
# DOWN, and the task parked after the offer waited for a circuit that was UP.
HOLD_FOR_DEPENDENCIES = HandWritten(
    f"""
    WITH wanted AS (
        SELECT * FROM unnest(CAST(:task_ids AS uuid[]), CAST(:keys AS text[]), CAST(:budgets_ms AS bigint[]))
            AS w(task_id, key, budget_ms)
    ),
    down AS MATERIALIZED (
        SELECT d.key, d.probe_task_id FROM dependencies d
        WHERE d.key IN (SELECT key FROM wanted) AND d.state <> '{DependencyState.UP}'
        ORDER BY d.key
        FOR SHARE
    ),
    held AS (
        SELECT DISTINCT ON (w.task_id) w.task_id, w.key, w.budget_ms
        FROM wanted w JOIN down d ON d.key = w.key
        WHERE d.probe_task_id IS DISTINCT FROM w.task_id
        ORDER BY w.task_id, w.key
    )
    UPDATE tasks t
    SET state = '{TaskState.PARKED}', parked_on = held.key, attempt = t.attempt - 1,
        lease_owner = NULL, lease_token_hash = NULL, lease_expires_at = NULL,
        waiting_since = coalesce(t.waiting_since, now()),
        outage_deadline = coalesce(t.outage_deadline, now() + held.budget_ms * interval '1 millisecond')
    FROM held
    WHERE t.id = held.task_id AND t.state = '{TaskState.LEASED}'
    RETURNING t.id, held.key
    """
)


async def hold_for_dependencies(
    conn: Executor, task_ids: Sequence[uuid.UUID], keys: Sequence[str], budgets_ms: Sequence[int]
) -> dict[uuid.UUID, str]:
    """Of the (task, dependency, outage budget) triples, parks each task held by a dependency that is
    down; returns the parked tasks and what each waits for."""
    rows = await HOLD_FOR_DEPENDENCIES.fetch(
        conn, {"task_ids": list(task_ids), "keys": list(keys), "budgets_ms": list(budgets_ms)}
    )
    return {row["id"]: row["key"] for row in rows}


async def release_parked(conn: AsyncConnection, dependency: str) -> int:
    """`dependency` answers again: every task parked for it is fetchable at once, its outage over."""
    topics = (
        (
            await conn.execute(
                update(tasks)
                .where(is_(tasks.c.state, TaskState.PARKED), tasks.c.parked_on == dependency)
                .values(state=TaskState.READY, due_at=func.now(), **_NO_OUTAGE)
                .returning(tasks.c.topic)
            )
        )
        .scalars()
        .all()
    )
    for topic in set(topics):
        await announce_work(conn, topic)
    return len(topics)


async def release_probe(conn: AsyncConnection, dependency: str) -> uuid.UUID | None:
    """The oldest task parked for `dependency` is fetchable at once, as its probe (None: none waits).
    It keeps its waiting streak: a probe that fails again counts against the same outage budget."""
    oldest = (
        select(tasks.c.id)
        .where(is_(tasks.c.state, TaskState.PARKED), tasks.c.parked_on == dependency)
        .order_by(tasks.c.created_at)
        .limit(1)
        .with_for_update(skip_locked=True)
        .scalar_subquery()
    )
    row = (
        await conn.execute(
            update(tasks)
            .where(tasks.c.id == oldest)
            .values(state=TaskState.READY, due_at=func.now(), parked_on=None)
            .returning(tasks.c.id, tasks.c.topic)
        )
    ).one_or_none()
    if row is None:
        return None
    await announce_work(conn, row.topic)
    task_id: uuid.UUID = row.id
    return task_id


@dataclass(slots=True)
class OverdueTask:
    """A parked task whose outage budget ran out."""

    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    parked_on: str
    waiting_since: datetime
    now: datetime


async def lock_overdue_parked(conn: AsyncConnection, limit: int) -> list[OverdueTask]:
    """Parked tasks past their outage deadline, locked (SKIP LOCKED) for an incident each."""
    query = (
        select(
            tasks.c.id,
            tasks.c.instance_id,
            tasks.c.node_id,
            tasks.c.parked_on,
            tasks.c.waiting_since,
            func.now().label("now"),
        )
        .where(is_(tasks.c.state, TaskState.PARKED), tasks.c.outage_deadline <= func.now())
        .order_by(tasks.c.outage_deadline)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    return [typed(OverdueTask, row._mapping) for row in (await conn.execute(query)).all()]


async def announce_work(conn: AsyncConnection, topic: str) -> None:
    """Wake fetchers waiting on `topic`, on every replica, when the transaction commits."""
    await conn.execute(select(func.pg_notify(TASK_CHANNEL, topic)))


async def cancel_open_tasks(
    conn: AsyncConnection, instance_id: uuid.UUID, but: uuid.UUID | None = None
) -> None:
    """Withdraw the instance's open tasks (all of them, or all but `but`: a join passing on `any`)."""
    condition = and_(tasks.c.instance_id == instance_id, one_of(tasks.c.state, OPEN_TASK_STATES))
    if but is not None:
        condition = and_(condition, tasks.c.id != but)
    await conn.execute(update(tasks).where(condition).values(state=TaskState.CANCELED, lease_token_hash=None))


@dataclass(slots=True)
class LockedTaskRow:
    """A task waiting on something other than a worker (a person, a called process), with what its
    instance knows; both rows locked."""

    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    state: str
    kind: str
    definition_id: uuid.UUID
    variables: dict[str, Any]


async def lock_task_and_instance(conn: AsyncConnection, task_id: uuid.UUID) -> LockedTaskRow | None:
    """The task and its instance, both locked; None if there is no such task. A user task about to be
    completed by a person, or a call activity's task about to end with its called instance."""
    row = (
        await conn.execute(
            select(
                tasks.c.id,
                tasks.c.instance_id,
                tasks.c.node_id,
                tasks.c.state,
                tasks.c.kind,
                instances.c.definition_id,
                instances.c.variables,
            )
            .join(instances, instances.c.id == tasks.c.instance_id)
            .where(tasks.c.id == task_id)
            .with_for_update(of=[tasks, instances])
        )
    ).one_or_none()
    return typed(LockedTaskRow, row._mapping) if row is not None else None


async def mark_task_completed(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """A task no worker holds (a user task, a call activity's) ends COMPLETED."""
    await conn.execute(
        update(tasks).where(tasks.c.id == task_id).values(state=TaskState.COMPLETED, completed_at=func.now())
    )


async def waiting_user_tasks(
    conn: AsyncConnection,
    instance_id: uuid.UUID | None,
    limit: int = 1000,
    after_key: tuple[datetime, uuid.UUID] | None = None,
) -> list[Any]:
    """User tasks waiting for a person, oldest first, after `after_key` (the partial index
    `tasks_waiting_user` yields them in this order)."""
    waiting = (
        select(
            tasks.c.id,
            tasks.c.instance_id,
            tasks.c.node_id,
            tasks.c.payload,
            tasks.c.created_at,
            instances.c.process_id,
        )
        .join(instances, instances.c.id == tasks.c.instance_id)
        .where(is_(tasks.c.kind, TaskKind.USER), is_(tasks.c.state, TaskState.WAITING))
    )
    if instance_id is not None:
        waiting = waiting.where(tasks.c.instance_id == instance_id)
    query = keyset.ordered(waiting, (tasks.c.created_at, tasks.c.id), after_key).limit(limit)
    return list((await conn.execute(query)).all())


@dataclass(slots=True)
class Placement:
    """Where a task stands: its node, in its instance's definition."""

    node_id: str
    definition_id: uuid.UUID


async def placement(conn: AsyncConnection, task_id: uuid.UUID) -> Placement | None:
    row = (
        await conn.execute(
            select(tasks.c.node_id, instances.c.definition_id)
            .join(instances, instances.c.id == tasks.c.instance_id)
            .where(tasks.c.id == task_id)
        )
    ).one_or_none()
    return Placement(row.node_id, row.definition_id) if row is not None else None


@dataclass(slots=True)
class ExpiredAgentTask:
    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    definition_id: uuid.UUID


async def lock_expired_leases_over_tool_calls(
    conn: AsyncConnection, limit: int, grace_ms: int = 0
) -> list[ExpiredAgentTask]:
    """Agent tasks whose lease ran out more than `grace_ms` ago while a tool call was STARTED, locked
    (SKIP LOCKED) for a decision."""
    open_tool_call = (
        select(literal_column("1"))
        .select_from(journal_steps)
        .where(
            journal_steps.c.task_id == tasks.c.id,
            journal_steps.c.kind == StepKind.TOOL_CALL,
            journal_steps.c.state == StepState.STARTED,
            ~journal_steps.c.abandoned,
        )
        .exists()
    )
    query = (
        select(tasks.c.id, tasks.c.instance_id, tasks.c.node_id, instances.c.definition_id)
        .join(instances, instances.c.id == tasks.c.instance_id)
        .where(
            and_(
                is_(tasks.c.state, TaskState.LEASED),
                tasks.c.lease_expires_at
                <= func.now() - bindparam("grace_ms", grace_ms, Integer) * _MILLISECOND,
                tasks.c.topic == "abada:agent",
                open_tool_call,
            )
        )
        .order_by(tasks.c.due_at)
        .limit(limit)
        .with_for_update(of=tasks, skip_locked=True)
    )
    return [typed(ExpiredAgentTask, row._mapping) for row in (await conn.execute(query)).all()]


@dataclass(slots=True)
class TopicCounts:
    topic: str
    ready: int
    leased: int
    delayed: int
    oldest: float
    parked: int = 0


async def topic_counts(conn: AsyncConnection, topic: str | None = None) -> list[TopicCounts]:
    """Per topic: fetchable now (an expired lease counts), under a live lease, waiting out a backoff,
    parked for a dependency."""
    fetchable = one_of(tasks.c.state, FETCHABLE)
    due = and_(fetchable, tasks.c.due_at <= func.now())
    not_due = tasks.c.due_at > func.now()
    query = (
        select(
            tasks.c.topic,
            func.count().filter(due).label("ready"),
            func.count().filter(and_(is_(tasks.c.state, TaskState.LEASED), not_due)).label("leased"),
            func.count().filter(and_(is_(tasks.c.state, TaskState.READY), not_due)).label("delayed"),
            func.coalesce(extract("epoch", func.now() - func.min(tasks.c.due_at).filter(due)), 0).label(
                "oldest"
            ),
            func.count().filter(is_(tasks.c.state, TaskState.PARKED)).label("parked"),
        )
        .where(one_of(tasks.c.state, (*FETCHABLE, TaskState.PARKED)))
        .group_by(tasks.c.topic)
    )
    query = (
        query.where(tasks.c.topic == topic) if topic is not None else query.where(tasks.c.topic.is_not(None))
    )
    return [
        TopicCounts(r.topic, r.ready, r.leased, r.delayed, float(r.oldest), r.parked)
        for r in (await conn.execute(query)).all()
    ]


@dataclass(slots=True)
class QueuedTaskRow:
    """An unfinished external task as an operator lists it, with the database's clock to judge it by."""

    id: uuid.UUID
    topic: str
    instance_id: uuid.UUID
    process_id: str
    node_id: str
    state: str
    attempt: int
    retries_left: int
    lease_owner: str | None
    lease_expires_at: datetime | None
    due_at: datetime | None
    created_at: datetime
    now: datetime
    parked_on: str | None = None


async def open_external_tasks(
    conn: AsyncConnection,
    topic: str | None,
    instance_id: uuid.UUID | None,
    limit: int,
    after_key: tuple[datetime, uuid.UUID] | None = None,
) -> list[QueuedTaskRow]:
    """External tasks still ready, leased, parked for a dependency or held by an incident, oldest first,
    after `after_key` (the partial indexes `tasks_open_external*` yield them in this order)."""
    open_tasks = (
        select(
            tasks.c.id,
            tasks.c.topic,
            tasks.c.instance_id,
            instances.c.process_id,
            tasks.c.node_id,
            tasks.c.state,
            tasks.c.attempt,
            tasks.c.retries_left,
            tasks.c.lease_owner,
            tasks.c.lease_expires_at,
            tasks.c.due_at,
            tasks.c.created_at,
            func.now().label("now"),
            tasks.c.parked_on,
        )
        .join(instances, instances.c.id == tasks.c.instance_id)
        .where(
            is_(tasks.c.kind, TaskKind.EXTERNAL),
            one_of(tasks.c.state, OPEN_EXTERNAL_STATES),
        )
    )
    query = keyset.ordered(open_tasks, (tasks.c.created_at, tasks.c.id), after_key).limit(limit)
    if topic is not None:
        query = query.where(tasks.c.topic == topic)
    if instance_id is not None:
        query = query.where(tasks.c.instance_id == instance_id)
    return [typed(QueuedTaskRow, row._mapping) for row in (await conn.execute(query)).all()]
