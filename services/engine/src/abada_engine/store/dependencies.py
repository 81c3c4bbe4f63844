"""Dependencies' circuits: one row per dependency a worker reported on, and its transitions.

UP (closed) -> DOWN (open) when a worker reports a failure; DOWN -> PROBING (half-open) when the
probe time comes and one parked task is offered again; PROBING -> UP when a call gets through, or
-> DOWN again when the probe fails too (or leaves without a word). Every transition locks the row,
so replicas deciding at the same moment take turns; probes are picked with SKIP LOCKED.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import dependencies, tasks

from .hand_written import typed
from .states import DependencyState, TaskState, is_

# PostgreSQL NOTIFY channel: every transaction that changes a circuit sends it, so every replica's
# view of the dependencies (`runtime/dependencies.py`) follows at once.
DEPENDENCY_CHANNEL = "abada_dependencies"


@dataclass(slots=True)
class CircuitRow:
    key: str
    kind: str
    name: str
    state: str
    down_since: datetime | None
    failed_probes: int
    last_error: str
    next_probe_at: datetime | None
    probe_task_id: uuid.UUID | None
    updated_at: datetime


@dataclass(slots=True)
class ListedCircuit(CircuitRow):
    held_tasks: int


async def lock(conn: AsyncConnection, key: str, kind: str, name: str) -> CircuitRow:
    """The dependency's circuit, locked for the caller's transaction; created UP on first mention."""
    await conn.execute(
        insert(dependencies)
        .values(
            key=key,
            kind=kind,
            name=name,
            state=DependencyState.UP,
            failed_probes=0,
            last_error="",
            updated_at=func.now(),
        )
        .on_conflict_do_nothing(index_elements=[dependencies.c.key])
    )
    row = (await conn.execute(select(dependencies).where(dependencies.c.key == key).with_for_update())).one()
    return typed(CircuitRow, row._mapping)


async def open_circuit(
    conn: AsyncConnection, key: str, error: str, next_probe_at: datetime, probe_task_id: uuid.UUID
) -> None:
    """UP -> DOWN: the first failure of an outage; the task that met it is the first probe."""
    await _set(
        conn,
        key,
        state=DependencyState.DOWN,
        down_since=func.now(),
        failed_probes=0,
        last_error=error,
        next_probe_at=next_probe_at,
        probe_task_id=probe_task_id,
    )


async def probe_failed(
    conn: AsyncConnection, key: str, error: str, next_probe_at: datetime, probe_task_id: uuid.UUID | None
) -> None:
    """The probe failed too: DOWN until `next_probe_at`, the probe kept (it waits) or let go (parked)."""
    await _set(
        conn,
        key,
        state=DependencyState.DOWN,
        failed_probes=dependencies.c.failed_probes + 1,
        last_error=error,
        next_probe_at=next_probe_at,
        probe_task_id=probe_task_id,
    )


async def note_failure(conn: AsyncConnection, key: str, error: str, not_before: datetime | None) -> None:
    """Another task met the outage: its error is the latest word, and a Retry-After it brought
    postpones the next probe."""
    values: dict[str, object] = {"last_error": error}
    if not_before is not None:
        values["next_probe_at"] = func.greatest(dependencies.c.next_probe_at, not_before)
    await _set(conn, key, **values)


async def let_probe_go(conn: AsyncConnection, key: str) -> None:
    """The probe is parked (or gone) without having got through: the next one goes out at the next
    probe time, picked among the parked tasks."""
    await _set(conn, key, state=DependencyState.DOWN, probe_task_id=None)


async def close_circuit(conn: AsyncConnection, key: str) -> None:
    """A call got through: UP, and the outage forgotten."""
    await _set(
        conn,
        key,
        state=DependencyState.UP,
        down_since=None,
        failed_probes=0,
        next_probe_at=None,
        probe_task_id=None,
    )


async def send_probe(conn: AsyncConnection, key: str, task_id: uuid.UUID) -> None:
    """DOWN -> PROBING: `task_id` is out as the probe."""
    await _set(conn, key, state=DependencyState.PROBING, probe_task_id=task_id)


async def probe_now(conn: AsyncConnection, key: str) -> bool:
    """An operator says the dependency is back (a bulk retry of its incidents): the next probe goes
    out at once; False when the dependency is up or unknown."""
    result = await conn.execute(
        update(dependencies)
        .where(dependencies.c.key == key, dependencies.c.state != DependencyState.UP)
        .values(
            state=DependencyState.DOWN, next_probe_at=func.now(), probe_task_id=None, updated_at=func.now()
        )
    )
    if result.rowcount:
        await announce(conn, key)
    return bool(result.rowcount)


async def _set(conn: AsyncConnection, key: str, **values: object) -> None:
    await conn.execute(
        update(dependencies).where(dependencies.c.key == key).values(**values, updated_at=func.now())
    )
    await announce(conn, key)


async def announce(conn: AsyncConnection, key: str) -> None:
    """Every replica's view of `key` is refreshed when the transaction commits."""
    await conn.execute(select(func.pg_notify(DEPENDENCY_CHANNEL, key)))


# A circuit beside its probe task, if it has one; the probe is out while that task is ready or leased
# (a task waiting in place as the probe keeps its lease), and no longer out once it is anything else.
_WITH_PROBE_TASK = dependencies.outerjoin(tasks, tasks.c.id == dependencies.c.probe_task_id)
_PROBE_NOT_OUT = func.coalesce(tasks.c.state, "").not_in([TaskState.READY, TaskState.LEASED])


async def due_probes(conn: AsyncConnection, limit: int) -> list[CircuitRow]:
    """DOWN circuits whose probe time came and whose probe is not still out (the task that met the
    outage waits in place, holding its lease, and tries again itself), locked (SKIP LOCKED: one replica
    sends each probe)."""
    query = (
        select(dependencies)
        .select_from(_WITH_PROBE_TASK)
        .where(
            is_(dependencies.c.state, DependencyState.DOWN),
            dependencies.c.next_probe_at <= func.now(),
            _PROBE_NOT_OUT,
        )
        .order_by(dependencies.c.next_probe_at)
        .limit(limit)
        .with_for_update(of=dependencies, skip_locked=True)
    )
    return [typed(CircuitRow, row._mapping) for row in (await conn.execute(query)).all()]


@dataclass(slots=True)
class ProbeStanding:
    key: str
    probe_task_id: uuid.UUID | None
    # The probe task's state now (None: no such task any more).
    task_state: str | None


async def lost_probes(conn: AsyncConnection, limit: int) -> list[ProbeStanding]:
    """PROBING circuits whose probe is no longer out (completed, cancelled, held by an incident, parked
    for another dependency), locked with SKIP LOCKED."""
    query = (
        select(dependencies.c.key, dependencies.c.probe_task_id, tasks.c.state.label("task_state"))
        .select_from(_WITH_PROBE_TASK)
        .where(is_(dependencies.c.state, DependencyState.PROBING), _PROBE_NOT_OUT)
        .limit(limit)
        .with_for_update(of=dependencies, skip_locked=True)
    )
    return [typed(ProbeStanding, row._mapping) for row in (await conn.execute(query)).all()]


async def not_up(conn: AsyncConnection) -> list[CircuitRow]:
    """Every circuit that is not UP: what a replica holds tasks back for."""
    query = select(dependencies).where(dependencies.c.state != DependencyState.UP)
    return [typed(CircuitRow, row._mapping) for row in (await conn.execute(query)).all()]


async def listed(conn: AsyncConnection) -> list[ListedCircuit]:
    """Every circuit with the tasks parked for it, by kind and name."""
    held = (
        select(func.count())
        .select_from(tasks)
        .where(is_(tasks.c.state, TaskState.PARKED), tasks.c.parked_on == dependencies.c.key)
        .scalar_subquery()
    )
    query = select(dependencies, held.label("held_tasks")).order_by(dependencies.c.kind, dependencies.c.name)
    return [typed(ListedCircuit, row._mapping) for row in (await conn.execute(query)).all()]


async def database_now(conn: AsyncConnection) -> datetime:
    """The database's clock: every replica judges probe times by it, not by its own."""
    now: datetime = (await conn.execute(select(func.now()))).scalar_one()
    return now
