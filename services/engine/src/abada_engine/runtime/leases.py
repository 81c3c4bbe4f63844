"""Leases on external tasks: handing work out exactly once, renewing, checking the holder.

A task is fetchable when it is due: READY past its backoff, or LEASED past its
lease's expiry (its holder is presumed dead). Locking is one statement with
`FOR UPDATE SKIP LOCKED`, so concurrent fetchers never wait on each other and
never receive the same task.

A lease that ran out with nobody taking over is still its holder's. Expiry exists so that
another worker can take over from a dead one; until somebody has (a fetch gives the task a new
attempt, owner and token), nothing has been handed to anyone else, and a holder that was merely cut
off (the engine restarting, PostgreSQL away, the network down) may come back:

- `ExtendLease` by that holder re-grants the lease from now, same attempt, same token;
- `AppendStep` finishing a step (COMPLETED / FAILED) by that holder is accepted, so a model turn or
  a tool call that returned during the outage is journaled and never paid for again;
- anything that begins something new (a STARTED step, `Complete`, `Fail`) and `VerifyLease` (the
  broker's credentials last no longer than the lease) still needs a live lease, so the holder renews
  first and a takeover racing it never meets two workers both starting work.

An expired lease is evidence that its holder is dead only if the holder could have renewed it. While
the engine was away (this replica starting again after a crash, or its database coming back) nobody
could; and once it answers again, a holder that was cut off needs a moment to notice (its next try is
up to a few seconds away). So for `TAKEOVER_GRACE_SECONDS` after a replica starts, and after its
database comes back, its fetches take over no expired lease: the holders that are alive renew or
journal what they have first. (Without it, one engine restart in a few hundred let a long-polling
worker take over a task whose holder had a finished model turn in hand, and the turn was paid twice.)

The row lock of the holder's request and the fetch's `FOR UPDATE SKIP LOCKED` settle the race with
a fetcher: whichever locks the row first wins; the other sees a fresh lease or a new holder
(NOT_LEASE_HOLDER: the lease is truly lost). The alternative, attempt + 1 with the late result
kept, would hand the task to the next fetcher even when the holder is alive with the answer in hand.
An unkeyed write in flight is no exception while nobody asks: the engine's reaper raises
TOOL_OUTCOME_UNKNOWN for it only a grace past the lease's expiry (`journal/takeover.py`), so a holder
that comes back with the write's answer journals it and goes on. A fetch in the meantime is a takeover:
it holds the task for a person at once (the new attempt may not re-send the write), and the late
COMPLETED then finds the task held (TASK_NOT_LEASED).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import ToolBinding
from abada_engine.definitions.providers import provider_of_model
from abada_engine.errors import Category, EngineError, invalid, not_found, precondition
from abada_engine.metrics import LEASE_EXPIRIES
from abada_engine.runtime.background.handed_out import HandedOut, LeaseHeld
from abada_engine.runtime.background.wakeups import TaskWakeups
from abada_engine.runtime.flow.navigator import HistoryEntry
from abada_engine.runtime.flow.tokens import history_record, write_history
from abada_engine.runtime.views import AgentWorkView, HeldBack, LockedTask
from abada_engine.store import tasks as task_store
from abada_engine.store.hand_written import Executor, HotPath
from abada_engine.store.journal_steps import AppendContext
from abada_engine.store.states import InstanceState, TaskState
from abada_engine.store.tasks import LeaseRow, LockedRow

MIN_LEASE_MS = 1_000
MAX_LEASE_MS = 3_600_000
MAX_WAIT_MS = 60_000
MAX_TASKS = 500
# Longer than a cut-off worker takes to try again once the engine answers (at most about 2.4 s between
# tries, with jitter) by a margin.
TAKEOVER_GRACE_SECONDS = 5.0

__all__ = [
    "TAKEOVER_GRACE_SECONDS",
    "LeaseHeld",
    "Leases",
    "Subscription",
    "check_fetch",
    "hash_token",
    "held_from_row",
    "hold_lease",
]


class HoldsBack(Protocol):
    """Parks the tasks just locked that a dependency which is down holds, and names each other task's
    probes (`runtime/dependencies.py`)."""

    async def hold_back(self, conn: Executor, locked: Sequence[LockedRow]) -> HeldBack: ...


class AfterLock(Protocol):
    """Runs on the tasks just locked, before they are handed out (the journal's takeover: it attaches
    steps and holds tasks whose unkeyed write may have happened)."""

    async def on_locked(self, tasks: list[LockedTask], prior_states: list[str]) -> list[LockedTask]: ...


@dataclass(frozen=True)
class Subscription:
    topic: str
    lease_ms: int


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Leases:
    def __init__(
        self,
        engine: AsyncEngine,
        catalog: DefinitionCatalog,
        wakeups: TaskWakeups | None,
        handed_out: HandedOut | None = None,
        after_lock: AfterLock | None = None,
        hot: HotPath | None = None,
        takeover_grace_seconds: float = TAKEOVER_GRACE_SECONDS,
        dependencies: HoldsBack | None = None,
    ) -> None:
        self._hot = hot if hot is not None else HotPath(engine)
        self._dependencies = dependencies
        self._after_lock = after_lock
        self._takeover_grace = takeover_grace_seconds
        self._takeovers_from = 0.0
        self.hold_takeovers(takeover_grace_seconds)
        self._handed_out = handed_out if handed_out is not None else HandedOut()
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._wakeups = wakeups

    def hold_takeovers(self, seconds: float) -> None:
        """Take over no expired lease for `seconds` from now (see the module's docstring)."""
        self._takeovers_from = max(self._takeovers_from, time.monotonic() + seconds)

    def database_changed(self, reachable: bool) -> None:
        """The database came back (or went away): its leases' holders could renew nothing meanwhile."""
        if reachable:
            self.hold_takeovers(self._takeover_grace)

    def _takeovers_held_for(self) -> float:
        return max(0.0, self._takeovers_from - time.monotonic())

    async def fetch_and_lock(
        self, worker_id: str, subscriptions: Sequence[Subscription], max_tasks: int, wait_ms: int
    ) -> list[LockedTask]:
        check_fetch(worker_id, subscriptions, max_tasks, wait_ms)
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
                due_in = await task_store.seconds_until_due(conn, topics)
            if due_in is not None and due_in <= 0:
                # Due but not ours: an expired lease while takeovers are held (or a task another fetch
                # has locked). Not before the grace ends, then.
                due_in = self._takeovers_held_for()
            timeout = remaining if due_in is None else min(remaining, max(due_in, 0.0) + 0.005)
            if self._wakeups is None:
                await asyncio.sleep(min(timeout, 0.5))
            else:
                await self._wakeups.wait(topics, timeout)

    async def _lock(
        self, worker_id: str, subscriptions: Sequence[Subscription], max_tasks: int
    ) -> list[LockedTask]:
        tokens = [secrets.token_urlsafe(32) for _ in range(max_tasks)]
        # One statement, so autocommit is atomic and saves the BEGIN/COMMIT round trips.
        async with self._hot.connect() as conn:
            rows = await task_store.lease_due(
                conn,
                worker_id,
                [s.topic for s in subscriptions],
                [s.lease_ms for s in subscriptions],
                max_tasks,
                [hash_token(t) for t in tokens],
                takeovers=self._takeovers_held_for() == 0.0,
            )
            probes: dict[uuid.UUID, tuple[str, ...]] = {}
            if rows and self._dependencies is not None:
                held = await self._dependencies.hold_back(conn, rows)
                rows = [row for row in rows if row.id not in held.parked]
                probes = held.probes
        if not rows:
            return []
        tasks = [await self._locked_task(row, tokens[row.n - 1], probes.get(row.id, ())) for row in rows]
        for row in rows:
            if row.prior_state == TaskState.LEASED:
                LEASE_EXPIRIES.labels(row.topic).inc()
            self._handed_out.leased(
                _lease_held(
                    row,
                    row.lease_expires_at,
                    row.instance_variables,
                    InstanceState.ACTIVE,
                    lease_owner=worker_id,
                    lease_token_hash=hash_token(tokens[row.n - 1]),
                )
            )
        if self._after_lock is None:
            return tasks
        return await self._after_lock.on_locked(tasks, [row.prior_state for row in rows])

    async def _locked_task(self, row: LockedRow, token: str, probes: tuple[str, ...] = ()) -> LockedTask:
        payload = row.payload
        agent_work = None
        if row.topic == "abada:agent":
            definition = await self._catalog.get(row.definition_id)
            node = definition.process.node(row.node_id)
            agent_work = AgentWorkView(
                model=node.model or "",
                # Versions deployed before the field existed are read by the model name's family.
                provider=node.provider or provider_of_model(node.model or "") or "",
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
            business_key=row.business_key,
            retries_left=row.retries_left,
            probes=probes,
        )

    async def extend(self, task_id: uuid.UUID, worker_id: str, lease_token: str, lease_ms: int) -> datetime:
        if not MIN_LEASE_MS <= lease_ms <= MAX_LEASE_MS:
            raise invalid(
                ErrorReason.INVALID_LEASE, "lease_ms", f"must be between {MIN_LEASE_MS} and {MAX_LEASE_MS}"
            )
        async with self._engine.begin() as conn:
            # A lease that ran out with nobody taking over is re-granted to its holder.
            await hold_lease(conn, task_id, worker_id, lease_token, expired_ok=True)
            return await task_store.extend_lease(conn, task_id, lease_ms)

    async def release(self, task_id: uuid.UUID, worker_id: str, lease_token: str, reason: str) -> None:
        """Hand back a task its holder has not begun: offered again at once, no failed attempt counted.

        Only an attempt that journaled nothing may be handed back this way: one that did has spent
        something (a model turn, a tool call) and ends as any attempt does, by Fail or by its lease.
        A lease that ran out with nobody taking over may be handed back too.
        """
        async with self._engine.begin() as conn:
            held = await hold_lease(conn, task_id, worker_id, lease_token, expired_ok=True)
            if await task_store.attempt_has_steps(conn, task_id, held.attempt):
                raise precondition(
                    ErrorReason.ATTEMPT_BEGUN,
                    f"attempt {held.attempt} of task {task_id} has journaled steps: Fail it or let its lease lapse",
                    "task_id",
                )
            await task_store.release_unstarted(conn, task_id)
            entry = HistoryEntry(
                "TASK_RELEASED", held.node_id, {"worker_id": worker_id, "reason": reason[:200]}
            )
            await write_history(conn, [history_record(held.instance_id, entry, task_id)])

    async def verify(self, task_id: uuid.UUID, worker_id: str, lease_token: str) -> LeaseHeld:
        async with self._hot.connect() as conn:
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
            reason = ErrorReason.UNKNOWN_TASK if error.category is Category.NOT_FOUND else error.reason
            if reason == ErrorReason.TASK_NOT_LEASED:
                reason = ErrorReason.NOT_LEASE_HOLDER
            raise EngineError(Category.PERMISSION_DENIED, reason, error.message, field=error.field) from None
        definition = await self._catalog.get(held.definition_id)
        bindings = [b for b in definition.bindings_for(held.node_id) if b.server == server]
        if not bindings:
            raise EngineError(
                Category.PERMISSION_DENIED,
                ErrorReason.SERVER_NOT_BOUND,
                f"task {task_id} has no binding to tool server {server!r}",
                field="server",
            )
        return held, bindings


async def hold_lease(
    conn: Executor,
    task_id: uuid.UUID,
    worker_id: str,
    lease_token: str,
    lock: bool = True,
    *,
    expired_ok: bool = False,
) -> LeaseHeld:
    """Prove the caller holds the task's live lease; with `lock`, lock the task's row.

    Refusals never change anything: NOT_FOUND, TASK_NOT_LEASED, NOT_LEASE_HOLDER (wrong worker or token,
    indistinguishably) and LEASE_EXPIRED (the right holder, too late). With `expired_ok`, a lease that
    ran out with nobody taking over still counts as held (see the module's notes).
    """
    row = await task_store.read_lease(conn, task_id, lock=lock)
    return held_from_row(row, task_id, worker_id, lease_token, expired_ok=expired_ok)


def held_from_row(
    row: LeaseRow | AppendContext | None,
    task_id: uuid.UUID,
    worker_id: str,
    lease_token: str,
    *,
    expired_ok: bool = False,
) -> LeaseHeld:
    """The lease checks of `hold_lease`, on a row that has the columns of `LeaseRow`."""
    if row is None or row.state == TaskState.WAITING:
        raise not_found("external task", str(task_id), "task_id")
    holder = (
        row.lease_owner == worker_id
        and row.lease_token_hash is not None
        and hmac.compare_digest(bytes(row.lease_token_hash), hash_token(lease_token))
    )
    if row.state != TaskState.LEASED:
        if holder or row.state in (TaskState.COMPLETED, TaskState.CANCELED):
            raise precondition(
                ErrorReason.TASK_NOT_LEASED,
                f"task {task_id} is {row.state.lower()}, not under a lease",
                "task_id",
            )
        raise EngineError(
            Category.PERMISSION_DENIED,
            ErrorReason.NOT_LEASE_HOLDER,
            f"{worker_id!r} does not hold the lease on task {task_id}",
            field="lease_token",
        )
    if not holder:
        raise EngineError(
            Category.PERMISSION_DENIED,
            ErrorReason.NOT_LEASE_HOLDER,
            f"{worker_id!r} does not hold the lease on task {task_id}",
            field="lease_token",
        )
    if row.lease_expires_at is None or (not row.live and not expired_ok):
        # A row without an expiry (no lease at all) is refused the same way, without a time to show.
        when = f" at {row.lease_expires_at.isoformat()}" if row.lease_expires_at is not None else ""
        raise precondition(
            ErrorReason.LEASE_EXPIRED, f"the lease on task {task_id} expired{when}", "lease_token"
        )
    return _lease_held(row, row.lease_expires_at, row.variables, row.instance_state)


def _lease_held(
    row: LockedRow | LeaseRow | AppendContext,
    lease_expires_at: datetime,
    variables: dict[str, Any],
    instance_state: str,
    *,
    lease_owner: str = "",
    lease_token_hash: bytes = b"",
) -> LeaseHeld:
    """The lease a task row shows, just granted (`LockedRow`) or proved (`LeaseRow`). The caller passes
    the instance's variables and the expiry: the rows name the one differently, and a proved row's
    expiry is only known to be set once checked."""
    return LeaseHeld(
        row.id,
        row.instance_id,
        row.definition_id,
        row.node_id,
        row.attempt,
        row.retries_left,
        lease_expires_at,
        variables,
        instance_state,
        row.instance_xmin,
        lease_owner=lease_owner,
        lease_token_hash=lease_token_hash,
        called=row.called,
    )


def check_fetch(
    worker_id: str,
    subscriptions: Sequence[Subscription],
    max_tasks: int,
    wait_ms: int,
    field_prefix: str = "",
) -> None:
    """Refuse a fetch the engine would not run; `field_prefix` names where the fetch sits in the request."""
    if not worker_id.strip():
        raise invalid(ErrorReason.INVALID_ARGUMENT, "worker_id", "is required")
    if not subscriptions:
        raise invalid(ErrorReason.INVALID_ARGUMENT, f"{field_prefix}topics", "name at least one topic")
    seen: set[str] = set()
    for index, sub in enumerate(subscriptions):
        where = f"{field_prefix}topics[{index}]"
        if sub.topic in seen:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, f"{where}.name", f"topic {sub.topic!r} is listed twice"
            )
        seen.add(sub.topic)
        if not sub.topic:
            raise invalid(ErrorReason.INVALID_ARGUMENT, f"{where}.name", "is required")
        if not MIN_LEASE_MS <= sub.lease_ms <= MAX_LEASE_MS:
            raise invalid(
                ErrorReason.INVALID_LEASE,
                f"{where}.lease_ms",
                f"must be between {MIN_LEASE_MS} and {MAX_LEASE_MS}, not {sub.lease_ms}",
            )
    if not 1 <= max_tasks <= MAX_TASKS:
        raise invalid(
            ErrorReason.INVALID_ARGUMENT,
            f"{field_prefix}max_tasks",
            f"must be between 1 and {MAX_TASKS}, not {max_tasks}",
        )
    if not 0 <= wait_ms <= MAX_WAIT_MS:
        raise invalid(
            ErrorReason.INVALID_ARGUMENT, "wait_ms", f"must be between 0 and {MAX_WAIT_MS}, not {wait_ms}"
        )
