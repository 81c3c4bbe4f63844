"""Letting old data go: which finished instances are due, and deleting instances with every row of theirs.

An instance's rows live in the instance, its tasks, the tasks' journal steps and model-quota rows, its
approvals, timers, incidents, history, the messages correlated to it and its remembered start request.
`delete_instances` takes them all in one transaction, children first (the foreign keys are checked
per statement). Callers keep each call to a bounded batch, so every transaction stays short.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnClause,
    Table,
    Uuid,
    and_,
    any_,
    bindparam,
    delete,
    func,
    insert,
    lateral,
    literal_column,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import (
    approvals,
    definitions,
    erasures,
    fan_outs,
    history,
    incidents,
    instances,
    journal_steps,
    messages,
    model_quota_calls,
    model_quota_waiters,
    start_requests,
    tasks,
    timers,
)

from .states import InstanceState

# One replica at a time runs the retention job (a session advisory lock; the number is this engine's own).
_RETENTION_LOCK = 0x61626164_0002
_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)").bindparams(key=_RETENTION_LOCK)
_UNLOCK = text("SELECT pg_advisory_unlock(:key)").bindparams(key=_RETENTION_LOCK)

_SECOND: ColumnClause[Any] = literal_column("interval '1 second'")
# The finished states, inlined so the planner matches the partial index `instances_finished_ended`.
_FINISHED = instances.c.state != literal_column(f"'{InstanceState.ACTIVE}'")


# The tables reached through the instances' tasks.
_BY_TASK = ("journal_steps", "model_quota_calls", "model_quota_waiters")


@dataclass
class Deleted:
    """How many rows a deletion took, per table."""

    rows: dict[str, int] = field(default_factory=dict)

    @property
    def instances(self) -> int:
        return self.rows.get("instances", 0)

    @property
    def total(self) -> int:
        return sum(self.rows.values())

    def add(self, other: Deleted) -> None:
        for table, count in other.rows.items():
            self.rows[table] = self.rows.get(table, 0) + count


async def try_lock(conn: AsyncConnection) -> bool:
    return bool((await conn.execute(_TRY_LOCK)).scalar())


async def unlock(conn: AsyncConnection) -> None:
    await conn.execute(_UNLOCK)


def _ids(name: str, values: Sequence[uuid.UUID]) -> Any:
    return any_(bindparam(name, list(values), ARRAY(Uuid)))


def _finished_of_each_version(ended_before: Any, process_id: str, limit: int) -> Any:
    """Up to `limit` finished instances ended before `ended_before` (an expression of the version's
    row), oldest end first within each version: one index range per version, however many instances
    are still kept."""
    condition = true() if not process_id else definitions.c.process_id == process_id
    per_version = lateral(
        select(instances.c.id)
        .where(instances.c.definition_id == definitions.c.id, _FINISHED, instances.c.ended_at < ended_before)
        .order_by(instances.c.ended_at)
        .limit(limit)
    )
    return select(per_version.c.id).select_from(definitions).join(per_version, true()).where(condition)


async def due_for_retention(conn: AsyncConnection, limit: int) -> list[uuid.UUID]:
    """Finished instances whose version's retention has passed since they ended (at most `limit`).
    A version deployed before retention existed has none and keeps its instances (migration 0011)."""
    retention = definitions.c.retention_seconds
    query = (
        _finished_of_each_version(func.now() - retention * _SECOND, "", limit)
        .where(retention.is_not(None))
        .limit(limit)
    )
    return list((await conn.execute(query)).scalars())


async def ended_before(
    conn: AsyncConnection, before: datetime, process_id: str, limit: int
) -> list[uuid.UUID]:
    """Finished instances (of `process_id`, if given) that ended before `before` (at most `limit`)."""
    query = _finished_of_each_version(bindparam("before", before), process_id, limit).limit(limit)
    return list((await conn.execute(query)).scalars())


async def count_ended_before(conn: AsyncConnection, before: datetime, process_id: str) -> int:
    """How many finished instances (of `process_id`, if given) ended before `before`."""
    condition = and_(_FINISHED, instances.c.ended_at < before)
    if process_id:
        condition = condition & (instances.c.process_id == process_id)
    return int((await conn.execute(select(func.count()).where(condition))).scalar_one())


@dataclass(frozen=True, slots=True)
class Matched:
    id: uuid.UUID
    state: str


async def matching(
    conn: AsyncConnection,
    business_key: str,
    variables_holding: dict[str, Any] | None,
    limit: int,
    after: uuid.UUID | None = None,
) -> list[Matched]:
    """Instances of one customer, whatever their state or age: by business key and/or variables (the
    indexes `instances_business_key` and `instances_variables` answer), in id order after `after`."""
    condition: Any = true()
    if business_key:
        condition = condition & (instances.c.business_key == business_key)
    if variables_holding:
        condition = condition & instances.c.variables.contains(variables_holding)
    if after is not None:
        condition = condition & (instances.c.id > after)
    query = select(instances.c.id, instances.c.state).where(condition).order_by(instances.c.id).limit(limit)
    return [Matched(row.id, row.state) for row in await conn.execute(query)]


async def delete_instances(
    conn: AsyncConnection, instance_ids: Sequence[uuid.UUID], *, skip_locked: bool = True
) -> Deleted:
    """Delete the finished ones of `instance_ids` with every row of theirs, in the caller's transaction.

    An active instance is never deleted here (cancel it first). The instances are locked first, so a
    concurrent change to one (a late resolution, another deletion) waits or, with `skip_locked`, is
    left for the next round."""
    locking = (
        select(instances.c.id)
        .where(instances.c.id == _ids("ids", instance_ids), _FINISHED)
        .with_for_update(skip_locked=skip_locked)
    )
    locked = list((await conn.execute(locking)).scalars())
    if not locked:
        return Deleted()
    task_ids = list(
        (await conn.execute(select(tasks.c.id).where(tasks.c.instance_id == _ids("ids", locked)))).scalars()
    )
    steps: list[tuple[str, Table, Any]] = [
        ("journal_steps", journal_steps, journal_steps.c.task_id == _ids("task_ids", task_ids)),
        ("model_quota_calls", model_quota_calls, model_quota_calls.c.task_id == _ids("task_ids", task_ids)),
        (
            "model_quota_waiters",
            model_quota_waiters,
            model_quota_waiters.c.task_id == _ids("task_ids", task_ids),
        ),
        ("approvals", approvals, approvals.c.instance_id == _ids("ids", locked)),
        ("timers", timers, timers.c.instance_id == _ids("ids", locked)),
        ("incidents", incidents, incidents.c.instance_id == _ids("ids", locked)),
        ("history", history, history.c.instance_id == _ids("ids", locked)),
        ("messages", messages, messages.c.correlated_instance_id == _ids("ids", locked)),
        ("start_requests", start_requests, start_requests.c.instance_id == _ids("ids", locked)),
        ("fan_outs", fan_outs, fan_outs.c.instance_id == _ids("ids", locked)),
        ("tasks", tasks, tasks.c.instance_id == _ids("ids", locked)),
        ("instances", instances, instances.c.id == _ids("ids", locked)),
    ]
    deleted = Deleted()
    for name, table, condition in steps:
        if not task_ids and name in _BY_TASK:
            continue
        gone = await conn.execute(delete(table).where(condition))
        deleted.rows[name] = gone.rowcount or 0
    return deleted


async def forget_buffered_messages(conn: AsyncConnection, correlation_key: str) -> int:
    """Delete messages buffered for `correlation_key` that no instance took (an erasure's, for a key
    that names the customer)."""
    gone = await conn.execute(
        delete(messages).where(
            messages.c.correlation_key == correlation_key, messages.c.correlated_instance_id.is_(None)
        )
    )
    return gone.rowcount or 0


async def record_erasure(
    conn: AsyncConnection, erased_by: str, selected_by: str, instances_erased: int, canceled: int, rows: int
) -> int:
    """The erasure's audit row (who, when, how much; never whose): answers its id."""
    return int(
        (
            await conn.execute(
                insert(erasures)
                .values(
                    erased_by=erased_by,
                    erased_at=func.now(),
                    selected_by=selected_by,
                    instances=instances_erased,
                    canceled=canceled,
                    rows=rows,
                )
                .returning(erasures.c.id)
            )
        ).scalar_one()
    )
