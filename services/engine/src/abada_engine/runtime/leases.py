"""Leases on external tasks: handing work out exactly once, renewing, checking the holder.

A task is fetchable when it is due: READY past its backoff, or LEASED past its
lease's expiry (its holder is presumed dead). Locking is one statement with
`FOR UPDATE SKIP LOCKED`, so concurrent fetchers never wait on each other and
never receive the same task.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.db.raw import RawSql
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import ToolBinding
from abada_engine.errors import Category, EngineError, invalid, not_found
from abada_engine.metrics import LEASE_EXPIRIES

from .views import AgentWorkView, LockedTask
from .wakeups import TaskWakeups

MIN_LEASE_MS = 1_000
MAX_LEASE_MS = 3_600_000
MAX_WAIT_MS = 60_000
MAX_TASKS = 500


# Runs on the tasks just locked (the journal attaches steps and holds unsafe takeovers here).
AfterLock = Callable[[list[LockedTask], list[str]], Awaitable[list[LockedTask]]]


@dataclass(frozen=True)
class Subscription:
    topic: str
    lease_ms: int


@dataclass(frozen=True)
class LeaseHeld:
    """A task row as seen by someone who proved they hold its live lease."""

    task_id: uuid.UUID
    instance_id: uuid.UUID
    definition_id: uuid.UUID
    node_id: str
    attempt: int
    retries_left: int
    lease_expires_at: datetime
    variables: dict[str, Any]
    instance_state: str
    # The instance row's version (PostgreSQL xmin): a write guarded by it fails if anything changed it.
    instance_xmin: str | None = None


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


_LOCK_SQL = RawSql(
    """
    WITH subscription AS (
        SELECT * FROM unnest(CAST(:topics AS text[]), CAST(:lease_ms AS bigint[])) AS s(topic, lease_ms)
    ),
    picked AS (
        SELECT t.id, s.lease_ms, t.state AS prior_state
        FROM tasks t JOIN subscription s ON s.topic = t.topic
        WHERE t.state IN ('READY', 'LEASED') AND t.due_at <= now()
        ORDER BY t.due_at
        LIMIT CAST(:max_tasks AS integer)
        FOR UPDATE OF t SKIP LOCKED
    ),
    numbered AS (SELECT picked.*, row_number() OVER () AS n FROM picked)
    UPDATE tasks t
    SET state = 'LEASED',
        attempt = t.attempt + 1,
        lease_owner = CAST(:worker_id AS text),
        lease_token_hash = token.hash,
        lease_expires_at = now() + numbered.lease_ms * interval '1 millisecond',
        due_at = now() + numbered.lease_ms * interval '1 millisecond'
    FROM numbered, unnest(CAST(:hashes AS bytea[])) WITH ORDINALITY AS token(hash, n), instances i
    WHERE t.id = numbered.id AND token.n = numbered.n AND i.id = t.instance_id
    RETURNING t.id, numbered.n, numbered.prior_state, t.instance_id, t.node_id, t.topic, t.payload, t.attempt,
              t.retries_left, t.lease_expires_at, i.definition_id, i.process_id, i.variables AS instance_variables,
              i.xmin::text AS instance_xmin
    """
)

_NEXT_DUE_SQL = text(
    """
    SELECT EXTRACT(EPOCH FROM (min(due_at) - now())) FROM tasks
    WHERE topic = ANY(CAST(:topics AS text[])) AND state IN ('READY', 'LEASED')
    """
)


class Leases:
    def __init__(
        self,
        engine: AsyncEngine,
        catalog: DefinitionCatalog,
        wakeups: TaskWakeups | None,
        after_lock: AfterLock | None = None,
        on_leased: Callable[[uuid.UUID, LeaseHeld], None] | None = None,
    ) -> None:
        self._after_lock = after_lock
        self._on_leased = on_leased
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._wakeups = wakeups

    async def fetch_and_lock(
        self, worker_id: str, subscriptions: Sequence[Subscription], max_tasks: int, wait_ms: int
    ) -> list[LockedTask]:
        _check_fetch(worker_id, subscriptions, max_tasks, wait_ms)
        deadline = time.monotonic() + wait_ms / 1000
        topics = [s.topic for s in subscriptions]
        while True:
            locked = await self._lock(worker_id, subscriptions, max_tasks)
            if locked:
                return locked
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            # Sleep until new work is announced, or until a backoff or a lease runs out.
            async with self._reads.connect() as conn:
                due_in = (await conn.execute(_NEXT_DUE_SQL, {"topics": topics})).scalar()
            timeout = remaining if due_in is None else min(remaining, max(float(due_in), 0.0) + 0.005)
            if self._wakeups is None:
                await asyncio.sleep(min(timeout, 0.5))
            else:
                await self._wakeups.wait(topics, timeout)

    async def _lock(
        self, worker_id: str, subscriptions: Sequence[Subscription], max_tasks: int
    ) -> list[LockedTask]:
        tokens = [secrets.token_urlsafe(32) for _ in range(max_tasks)]
        params = {
            "topics": [s.topic for s in subscriptions],
            "lease_ms": [s.lease_ms for s in subscriptions],
            "max_tasks": max_tasks,
            "worker_id": worker_id,
            "hashes": [hash_token(t) for t in tokens],
        }
        # One statement, so autocommit is atomic and saves the BEGIN/COMMIT round trips.
        async with self._reads.connect() as conn:
            rows = await _LOCK_SQL.fetch(conn, params)
        if not rows:
            return []
        tasks = [await self._locked_task(row, tokens[row.n - 1]) for row in rows]
        for row in rows:
            if row.prior_state == "LEASED":
                LEASE_EXPIRIES.labels(row.topic).inc()
            if self._on_leased is not None:
                self._on_leased(
                    row.id,
                    LeaseHeld(
                        row.id,
                        row.instance_id,
                        row.definition_id,
                        row.node_id,
                        row.attempt,
                        row.retries_left,
                        row.lease_expires_at,
                        row.instance_variables,
                        "ACTIVE",
                        row.instance_xmin,
                    ),
                )
        if self._after_lock is None:
            return tasks
        return await self._after_lock(tasks, [row.prior_state for row in rows])

    async def _locked_task(self, row: Any, token: str) -> LockedTask:
        payload = row.payload
        agent_work = None
        if row.topic == "abada:agent":
            definition = await self._catalog.get(row.definition_id)
            node = definition.process.node(row.node_id)
            agent_work = AgentWorkView(
                model=node.model or "",
                prompt=payload.get("prompt", ""),
                tool_bindings=definition.bindings_for(node.id),
                limits=node.limits,
                output_schema=node.output_schema,
                result_variable=node.result_variable or "",
                confidence_threshold=node.confidence_threshold,
            )
        return LockedTask(
            id=row.id,
            topic=row.topic,
            instance_id=row.instance_id,
            process_id=row.process_id,
            node_id=row.node_id,
            variables=payload.get("inputs", {}),
            attempt=row.attempt,
            lease_token=token,
            lease_expires_at=row.lease_expires_at,
            definition_id=row.definition_id,
            agent_work=agent_work,
        )

    async def extend(self, task_id: uuid.UUID, worker_id: str, lease_token: str, lease_ms: int) -> datetime:
        if not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
            raise invalid("INVALID_LEASE", "lease_ms", f"must be between {MIN_LEASE_MS} and {MAX_LEASE_MS}")
        async with self._engine.begin() as conn:
            await hold_lease(conn, task_id, worker_id, lease_token)
            expires = (
                await conn.execute(
                    text(
                        "UPDATE tasks SET lease_expires_at = now() + :ms * interval '1 millisecond', "
                        "due_at = now() + :ms * interval '1 millisecond' WHERE id = :id RETURNING lease_expires_at"
                    ),
                    {"ms": lease_ms, "id": task_id},
                )
            ).scalar_one()
        return expires

    async def verify(self, task_id: uuid.UUID, worker_id: str, lease_token: str) -> LeaseHeld:
        async with self._reads.connect() as conn:
            return await hold_lease(conn, task_id, worker_id, lease_token, lock=False)

    async def verify_for_server(
        self, task_id: uuid.UUID, worker_id: str, lease_token: str, server: str
    ) -> tuple[LeaseHeld, list[ToolBinding]]:
        """For the credential broker: the live lease, and the task's frozen bindings of `server`.

        Every refusal is PERMISSION_DENIED, so the broker learns nothing it could leak about
        tasks it was not asked about.
        """
        try:
            held = await self.verify(task_id, worker_id, lease_token)
        except EngineError as error:
            reason = "UNKNOWN_TASK" if error.category is Category.NOT_FOUND else error.reason
            if reason == "TASK_NOT_LEASED":
                reason = "NOT_LEASE_HOLDER"
            raise EngineError(Category.PERMISSION_DENIED, reason, error.message, field=error.field) from None
        definition = await self._catalog.get(held.definition_id)
        bindings = [b for b in definition.bindings_for(held.node_id) if b.server == server]
        if not bindings:
            raise EngineError(
                Category.PERMISSION_DENIED,
                "SERVER_NOT_BOUND",
                f"task {task_id} has no binding to tool server {server!r}",
                field="server",
            )
        return held, bindings


_HOLD_SQL = text(
    """
    SELECT t.id, t.instance_id, t.node_id, t.state, t.attempt, t.retries_left, t.lease_owner, t.lease_token_hash,
           t.lease_expires_at, t.lease_expires_at > now() AS live, i.definition_id, i.variables,
           i.state AS instance_state, i.xmin::text AS instance_xmin
    FROM tasks t JOIN instances i ON i.id = t.instance_id
    WHERE t.id = :id
    """
)


_HOLD = RawSql(_HOLD_SQL.text)
_HOLD_LOCKED = RawSql(_HOLD_SQL.text + " FOR UPDATE OF t, i")


async def hold_lease(
    conn: AsyncConnection, task_id: uuid.UUID, worker_id: str, lease_token: str, lock: bool = True
) -> LeaseHeld:
    """Prove the caller holds the task's live lease; with `lock`, lock task and instance rows.

    Refusals never change anything: NOT_FOUND, TASK_NOT_LEASED, NOT_LEASE_HOLDER (wrong worker or token,
    indistinguishably) and LEASE_EXPIRED (the right holder, too late).
    """
    row = await (_HOLD_LOCKED if lock else _HOLD).fetchrow(conn, {"id": task_id})
    return held_from_row(row, task_id, worker_id, lease_token)


def held_from_row(row: Any, task_id: uuid.UUID, worker_id: str, lease_token: str) -> LeaseHeld:
    """The lease checks of `hold_lease`, on a row that has the `_HOLD_SQL` columns."""
    if row is None or row.state == "WAITING":
        raise not_found("external task", str(task_id), "task_id")
    holder = (
        row.lease_owner == worker_id
        and row.lease_token_hash is not None
        and hmac.compare_digest(bytes(row.lease_token_hash), hash_token(lease_token))
    )
    if row.state != "LEASED":
        if holder or row.state in ("COMPLETED", "CANCELED"):
            raise EngineError(
                Category.FAILED_PRECONDITION,
                "TASK_NOT_LEASED",
                f"task {task_id} is {row.state.lower()}, not under a lease",
                field="task_id",
            )
        raise EngineError(
            Category.PERMISSION_DENIED,
            "NOT_LEASE_HOLDER",
            f"{worker_id!r} does not hold the lease on task {task_id}",
            field="lease_token",
        )
    if not holder:
        raise EngineError(
            Category.PERMISSION_DENIED,
            "NOT_LEASE_HOLDER",
            f"{worker_id!r} does not hold the lease on task {task_id}",
            field="lease_token",
        )
    if not row.live:
        raise EngineError(
            Category.FAILED_PRECONDITION,
            "LEASE_EXPIRED",
            f"the lease on task {task_id} expired at {row.lease_expires_at.isoformat()}",
            field="lease_token",
        )
    return LeaseHeld(
        row.id,
        row.instance_id,
        row.definition_id,
        row.node_id,
        row.attempt,
        row.retries_left,
        row.lease_expires_at,
        row.variables,
        row.instance_state,
        row.get("instance_xmin"),
    )


def _check_fetch(worker_id: str, subscriptions: Sequence[Subscription], max_tasks: int, wait_ms: int) -> None:
    if not worker_id.strip():
        raise invalid("INVALID_ARGUMENT", "worker_id", "is required")
    if not subscriptions:
        raise invalid("INVALID_ARGUMENT", "topics", "name at least one topic")
    seen: set[str] = set()
    for index, sub in enumerate(subscriptions):
        if sub.topic in seen:
            raise invalid("INVALID_ARGUMENT", f"topics[{index}].name", f"topic {sub.topic!r} is listed twice")
        seen.add(sub.topic)
        if not sub.topic:
            raise invalid("INVALID_ARGUMENT", f"topics[{index}].name", "is required")
        if not MIN_LEASE_MS <= sub.lease_ms <= MAX_LEASE_MS:
            raise invalid(
                "INVALID_LEASE",
                f"topics[{index}].lease_ms",
                f"must be between {MIN_LEASE_MS} and {MAX_LEASE_MS}, not {sub.lease_ms}",
            )
    if not 1 <= max_tasks <= MAX_TASKS:
        raise invalid("INVALID_ARGUMENT", "max_tasks", f"must be between 1 and {MAX_TASKS}, not {max_tasks}")
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise invalid("INVALID_ARGUMENT", "wait_ms", f"must be between 0 and {MAX_WAIT_MS}, not {wait_ms}")
