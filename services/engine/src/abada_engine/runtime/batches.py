"""Batch operations: one operation applied to every instance a filter matched, worked through by a
background job on any replica.

Creating a batch records the matching instances as its items, once: instances that match later are not
taken, and the outcome of each taken one is kept. The job claims a few pending items at a time
(`FOR UPDATE SKIP LOCKED`, so replicas share the work and never take the same instance) and applies the
batch's kind to each in a savepoint of one short transaction that also records the outcome: an instance
is worked on exactly once, and a transaction cut short by a restart leaves its items pending for the next
round. Each kind is one function over the engine's own per-instance operation (an incident's RETRY
resolution, `cancel_instance`, `migrate_instance` under a plan checked for that one instance,
`modify_instance`), never a copy of it.
"""

from __future__ import annotations

import builtins
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import Definition, DefinitionCatalog
from abada_engine.errors import EngineError, invalid, not_found, precondition
from abada_engine.ids import new_id
from abada_engine.runtime.batch_after_batch import batch_after_batch
from abada_engine.runtime.incidents import Incidents
from abada_engine.runtime.instances import cancel_instance
from abada_engine.runtime.repairs import (
    Modification,
    check_modification,
    migrate_instance,
    migration_versions,
    modify_instance,
    plan_between,
)
from abada_engine.store import batches as batch_store
from abada_engine.store.batches import BatchFilter, BatchItemRow, BatchRow, Claimed
from abada_engine.store.states import BatchKind, BatchOutcome, BatchState, InstanceState

log = logging.getLogger(__name__)

# Instances one transaction of the job works on: each instance row stays locked until the chunk
# commits, so a chunk is kept to a fraction of a second beside live traffic.
CHUNK = 50
# How long one round goes on claiming chunks before it yields to the next round.
ROUND_CHUNKS = 20
# MIGRATE batches whose definitions a replica keeps found at once.
_REMEMBERED_MIGRATIONS = 64
# Reasons and comments stored per instance are cut to this length.
_MAX_TEXT = 1000


@dataclass(frozen=True, slots=True)
class Outcome:
    outcome: BatchOutcome
    message: str = ""


# What a kind does to one instance, in the job's transaction. An EngineError it raises rolls its own
# savepoint back and is recorded as the instance's FAILED outcome.
KindFunction = Callable[[AsyncConnection, Claimed], Awaitable[Outcome]]


@dataclass(frozen=True, slots=True)
class Migration:
    """A MIGRATE batch's plan: the version its instances move to and the nodes renamed on the way (the
    filter's version is the one they leave)."""

    to_version: int
    mappings: dict[str, str]


@dataclass(frozen=True, slots=True)
class BatchView:
    """A batch as shown: its row, with the filter and parameters the row keeps as JSON read."""

    row: BatchRow
    filter: BatchFilter
    reason: str
    migration: Migration | None = None
    modification: Modification | None = None

    @property
    def pending(self) -> int:
        return self.row.total - self.row.done - self.row.skipped - self.row.failed


# The errors that say an instance no longer needs the operation: skipped, not failed.
_NOTHING_LEFT = frozenset(
    {ErrorReason.INSTANCE_NOT_ACTIVE, ErrorReason.INCIDENT_RESOLVED, ErrorReason.NOT_FOUND}
)


class Batches:
    def __init__(
        self, engine: AsyncEngine, incidents: Incidents, catalog: DefinitionCatalog, chunk: int = CHUNK
    ) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._incidents = incidents
        self._catalog = catalog
        self._chunk = chunk
        # The two definitions of each MIGRATE batch being worked on: found once, not once per instance.
        self._migration_versions: dict[uuid.UUID, tuple[Definition, Definition]] = {}
        self._kinds: dict[str, KindFunction] = {}
        self.register(BatchKind.RETRY_INCIDENTS, self._retry_incidents)
        self.register(BatchKind.CANCEL, self._cancel)
        self.register(BatchKind.MIGRATE, self._migrate)
        self.register(BatchKind.MODIFY, self._modify)

    def register(self, kind: str, function: KindFunction) -> None:
        """A kind of batch: `function` applies it to one claimed instance in the job's transaction."""
        self._kinds[kind] = function

    async def create(
        self,
        kind: str,
        which: BatchFilter,
        reason: str,
        created_by: str,
        migration: Migration | None = None,
        modification: Modification | None = None,
    ) -> BatchView:
        """Record the instances `which` matches now as the batch's items; a MIGRATE batch's plan and a
        MODIFY batch's changes are checked here, so a batch that could do nothing is refused whole."""
        if kind not in self._kinds:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "kind", f"must be one of {', '.join(self._kinds)}")
        if not which.process_id:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "filter.process_id", "is required")
        if which.state not in tuple(InstanceState):
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "filter.state", f"must be one of {', '.join(InstanceState)}"
            )
        if kind == BatchKind.CANCEL and not reason.strip():
            raise invalid(ErrorReason.INVALID_ARGUMENT, "reason", "is required to cancel instances")
        parameters: dict[str, Any] = {"reason": reason[:_MAX_TEXT]}
        if kind == BatchKind.MIGRATE:
            parameters.update(await self._checked_migration(which, migration))
        if kind == BatchKind.MODIFY:
            parameters.update(_checked_modification(which, modification, reason))
        batch_id = new_id()
        async with self._engine.begin() as conn:
            total = await batch_store.create(conn, batch_id, kind, which, parameters, created_by)
        log.info(
            "batch created",
            extra={"batch_id": str(batch_id), "kind": kind, "instances": total, "created_by": created_by},
        )
        return await self.get(batch_id)

    async def _checked_migration(self, which: BatchFilter, migration: Migration | None) -> dict[str, Any]:
        if migration is None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "migration", "is required to migrate instances")
        if which.version <= 0:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "filter.version", "name the version the instances leave"
            )
        if which.state != InstanceState.ACTIVE:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "filter.state", "only active instances migrate")
        await migration_versions(
            self._catalog, which.process_id, which.version, migration.to_version, migration.mappings
        )
        return {"to_version": migration.to_version, "mappings": migration.mappings}

    async def get(self, batch_id: uuid.UUID) -> BatchView:
        async with self._reads.connect() as conn:
            row = await batch_store.get(conn, batch_id)
        if row is None:
            raise not_found("batch", str(batch_id), "batch_id")
        return _view(row)

    async def list(self, limit: int) -> list[BatchView]:
        async with self._reads.connect() as conn:
            return [_view(r) for r in await batch_store.listed(conn, limit)]

    async def items(
        self, batch_id: uuid.UUID, limit: int, after: uuid.UUID | None, outcome: str
    ) -> builtins.list[BatchItemRow]:
        async with self._reads.connect() as conn:
            return await batch_store.items(conn, batch_id, limit, after, outcome)

    async def pause(self, batch_id: uuid.UUID) -> BatchView:
        return await self._change(batch_id, (BatchState.RUNNING, BatchState.PAUSED), BatchState.PAUSED)

    async def resume(self, batch_id: uuid.UUID) -> BatchView:
        return await self._change(batch_id, (BatchState.RUNNING, BatchState.PAUSED), BatchState.RUNNING)

    async def cancel(self, batch_id: uuid.UUID) -> BatchView:
        return await self._change(batch_id, (BatchState.RUNNING, BatchState.PAUSED), BatchState.CANCELED)

    async def _change(
        self, batch_id: uuid.UUID, from_states: tuple[BatchState, ...], to: BatchState
    ) -> BatchView:
        async with self._engine.begin() as conn:
            changed = await batch_store.change_state(conn, batch_id, from_states, to)
        view = await self.get(batch_id)
        if not changed:
            raise precondition(
                ErrorReason.BATCH_FINISHED, f"batch {batch_id} is {view.row.state.lower()}", "batch_id"
            )
        log.info("batch state changed", extra={"batch_id": str(batch_id), "state": to})
        return view

    async def round(self) -> int:
        """Work through pending items of running batches, a chunk per transaction, for up to
        ROUND_CHUNKS chunks; answers how many instances got their outcome."""
        return await batch_after_batch(self.step, self._chunk, most=ROUND_CHUNKS)

    async def step(self) -> int:
        """One chunk: claim up to `chunk` pending items, apply each one's kind, record the outcomes (all in
        one transaction); then complete the batches with nothing pending. Answers how many were claimed
        (an item that lost a deadlock to live traffic stays pending and is claimed again later)."""
        async with self._engine.begin() as conn:
            claimed = await batch_store.claim(conn, self._chunk)
            counts: dict[uuid.UUID, dict[BatchOutcome, int]] = {}
            for item in claimed:
                outcome = await self._apply(conn, item)
                if outcome is None:
                    continue
                await batch_store.record(
                    conn, item.batch_id, item.instance_id, outcome.outcome, outcome.message
                )
                per_batch = counts.setdefault(item.batch_id, {})
                per_batch[outcome.outcome] = per_batch.get(outcome.outcome, 0) + 1
            for batch_id, by_outcome in counts.items():
                await batch_store.count(
                    conn,
                    batch_id,
                    by_outcome.get(BatchOutcome.DONE, 0),
                    by_outcome.get(BatchOutcome.SKIPPED, 0),
                    by_outcome.get(BatchOutcome.FAILED, 0),
                )
        if len(claimed) < self._chunk:
            async with self._engine.begin() as conn:
                await batch_store.complete_finished(conn)
        return len(claimed)

    async def _apply(self, conn: AsyncConnection, item: Claimed) -> Outcome | None:
        kind = self._kinds.get(item.kind)
        if kind is None:  # a kind only a newer engine knows (a rolling upgrade): say so, go on
            return Outcome(BatchOutcome.FAILED, f"this engine does not know the batch kind {item.kind}")
        try:
            async with conn.begin_nested():
                return await kind(conn, item)
        except EngineError as error:
            if error.reason in _NOTHING_LEFT:
                return Outcome(BatchOutcome.SKIPPED, error.message[:_MAX_TEXT])
            return Outcome(BatchOutcome.FAILED, f"{error.reason_name}: {error.message}"[:_MAX_TEXT])
        except DBAPIError as error:
            if error.connection_invalidated:
                raise  # the whole chunk goes back to pending and is tried again next round
            if _transient(error):
                # Live traffic on the same instance won (a deadlock with a completion, a lock
                # timeout): this one instance stays pending for a later chunk, the others go on.
                log.info(
                    "batch item deferred", extra={"batch_id": str(item.batch_id), "error": str(error.orig)}
                )
                return None
            log.exception("batch item failed", extra={"batch_id": str(item.batch_id)})
            return Outcome(BatchOutcome.FAILED, f"the database refused it: {type(error.orig).__name__}")
        except Exception as error:  # a fault of ours on one instance must not hold the batch for ever
            log.exception("batch item failed", extra={"batch_id": str(item.batch_id)})
            return Outcome(BatchOutcome.FAILED, f"internal error: {type(error).__name__}")

    async def _retry_incidents(self, conn: AsyncConnection, item: Claimed) -> Outcome:
        which = BatchFilter.from_json(item.filter)
        found = await batch_store.open_incidents_of(conn, item.instance_id, which)
        if not found:
            return Outcome(BatchOutcome.SKIPPED, "no matching open incident any more")
        comment = f"batch {item.batch_id}"
        for incident_id in found:
            await self._incidents.resolve_in(conn, incident_id, "RETRY", None, comment)
        return Outcome(BatchOutcome.DONE, f"{len(found)} incident(s) retried")

    async def _cancel(self, conn: AsyncConnection, item: Claimed) -> Outcome:
        reason = str(item.parameters.get("reason", "")) or f"batch {item.batch_id}"
        await cancel_instance(conn, item.instance_id, reason)
        return Outcome(BatchOutcome.DONE, "canceled")

    async def _migrate(self, conn: AsyncConnection, item: Claimed) -> Outcome:
        which = BatchFilter.from_json(item.filter)
        migration = _migration(item.parameters)
        if migration is None:
            return Outcome(BatchOutcome.FAILED, "the batch names no migration plan")
        versions = self._migration_versions.get(item.batch_id)
        if versions is None:
            if len(self._migration_versions) >= _REMEMBERED_MIGRATIONS:
                self._migration_versions.clear()
            versions = await migration_versions(
                self._catalog, which.process_id, which.version, migration.to_version, migration.mappings
            )
            self._migration_versions[item.batch_id] = versions
        # The plan is checked for this instance alone, where it stands now: one whose token rests at a
        # node the target version lacks is refused, naming it, and leaves the others to migrate.
        plan = await plan_between(conn, *versions, migration.mappings, [item.instance_id])
        if not await migrate_instance(conn, plan, item.instance_id, item.created_by):
            return Outcome(BatchOutcome.SKIPPED, f"no longer active on {which.process_id} v{which.version}")
        return Outcome(BatchOutcome.DONE, f"migrated to v{migration.to_version}")

    async def _modify(self, conn: AsyncConnection, item: Claimed) -> Outcome:
        change = _modification(item.parameters)
        if change is None:
            return Outcome(BatchOutcome.FAILED, "the batch names no modification")
        await modify_instance(conn, self._catalog, item.instance_id, change, item.created_by)
        return Outcome(BatchOutcome.DONE, "modified")


def _checked_modification(
    which: BatchFilter, modification: Modification | None, reason: str
) -> dict[str, Any]:
    if modification is None:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "modification", "is required to modify instances")
    if which.state != InstanceState.ACTIVE:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "filter.state", "only active instances are modified")
    check_modification(
        Modification(reason, modification.set_variables, modification.unset_variables, modification.moves)
    )
    return {
        "set_variables": modification.set_variables,
        "unset_variables": list(modification.unset_variables),
        "moves": [list(move) for move in modification.moves],
    }


def _migration(parameters: dict[str, Any]) -> Migration | None:
    if "to_version" not in parameters:
        return None
    mappings = parameters.get("mappings") or {}
    return Migration(int(parameters["to_version"]), {str(k): str(v) for k, v in mappings.items()})


def _modification(parameters: dict[str, Any]) -> Modification | None:
    if not any(name in parameters for name in ("set_variables", "unset_variables", "moves")):
        return None
    return Modification(
        reason=str(parameters.get("reason", "")),
        set_variables=dict(parameters.get("set_variables") or {}),
        unset_variables=tuple(str(name) for name in parameters.get("unset_variables") or ()),
        moves=tuple((str(move[0]), str(move[1])) for move in parameters.get("moves") or ()),
    )


# SQLSTATE classes that pass: a deadlock or serialization failure (40), a lock or resource not available
# (55, 53), a cancelled statement or an operator intervention (57), a lost connection (08).
_TRANSIENT_CLASSES = frozenset({"40", "53", "55", "57", "08"})


def _transient(error: DBAPIError) -> bool:
    code = getattr(error.orig, "pgcode", None) or getattr(error.orig, "sqlstate", None)
    return isinstance(code, str) and code[:2] in _TRANSIENT_CLASSES


def _view(row: BatchRow) -> BatchView:
    return BatchView(
        row=row,
        filter=BatchFilter.from_json(row.filter),
        reason=str(row.parameters.get("reason", "")),
        migration=_migration(row.parameters) if row.kind == BatchKind.MIGRATE else None,
        modification=_modification(row.parameters) if row.kind == BatchKind.MODIFY else None,
    )
