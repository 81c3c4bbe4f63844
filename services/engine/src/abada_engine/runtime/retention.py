"""Letting old data go: the retention job, an operator's purge, and one customer's erasure.

Every deletion goes in batches of at most `batch` instances, each batch one short transaction that
takes an instance with every row of its own (store/retention.py): the hot path's rows are never held
for long, and a deletion cut short by a restart leaves whole instances, never half of one.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.errors import EngineError, invalid, precondition
from abada_engine.metrics import count_deleted
from abada_engine.runtime.batch_after_batch import batch_after_batch
from abada_engine.runtime.instances import cancel_instance
from abada_engine.store import retention as retention_store
from abada_engine.store.retention import Deleted

log = logging.getLogger(__name__)

# Instances a batch deletes: with a few dozen journal steps each, a transaction of some ten thousand
# rows, short enough that nothing waits on it noticeably.
BATCH = 500
# How long one round of the retention job may go on deleting before it yields to the next round.
ROUND_SECONDS = 5.0
# The job's pause between two batches: on a 2-core machine a batch of 500 instances (some 13,000
# rows) takes about 0.12 s, so the job deletes some 30,000 rows/s and task cycles beside it keep
# within 10 % of their rate (bench/retention.py; deleting flat out doubled their latency).
BATCH_PAUSE_SECONDS = 0.3
# The active instances an erasure refusal names (the rest are counted).
_NAMED_ACTIVE = 20


@dataclass(frozen=True, slots=True)
class Purged:
    instances: int
    rows: int
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Erased:
    instances: int
    canceled: int
    rows: int
    audit_id: int


class Retention:
    def __init__(
        self,
        engine: AsyncEngine,
        batch: int = BATCH,
        pause_seconds: float = BATCH_PAUSE_SECONDS,
        round_seconds: float = ROUND_SECONDS,
    ) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._batch = batch
        # The background job's pause between batches: room for the hot path. A purge or an erasure,
        # asked for by an operator, goes flat out.
        self._pause = pause_seconds
        self._round_seconds = round_seconds
        # Every row the retention job deleted on this replica since it started, per table.
        self.deleted = Deleted()

    async def round(self) -> int:
        """Delete finished instances past their version's retention, batch after batch, for up to
        `round_seconds`; answers how many went (0 while another replica holds the job)."""
        async with self._reads.connect() as conn:
            if not await retention_store.try_lock(conn):
                return 0
            try:
                deleted = Deleted()

                async def batch() -> int:
                    async with self._engine.begin() as batch_conn:
                        due = await retention_store.due_for_retention(batch_conn, self._batch)
                        gone = await retention_store.delete_instances(batch_conn, due) if due else Deleted()
                    deleted.add(gone)
                    self.deleted.add(gone)
                    count_deleted("retention", gone.rows)
                    return len(due)

                await batch_after_batch(
                    batch, self._batch, for_seconds=self._round_seconds, pause_seconds=self._pause
                )
                return deleted.instances
            finally:
                await retention_store.unlock(conn)

    async def purge(self, before: datetime, process_id: str = "", dry_run: bool = False) -> Purged:
        """Delete every finished instance (of `process_id`, if given) that ended before `before`, now,
        whatever its retention; with `dry_run`, count them only."""
        if before.tzinfo is None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "before", "needs a time zone (RFC 3339)")
        if dry_run:
            async with self._reads.connect() as conn:
                count = await retention_store.count_ended_before(conn, before, process_id)
            return Purged(count, 0, True)
        total = Deleted()

        async def batch() -> int:
            async with self._engine.begin() as conn:
                found = await retention_store.ended_before(conn, before, process_id, self._batch)
                gone = await retention_store.delete_instances(conn, found) if found else Deleted()
            total.add(gone)
            count_deleted("purge", gone.rows)
            return len(found)

        await batch_after_batch(batch, self._batch)
        log.info(
            "instances purged",
            extra={"before": before.isoformat(), "process_id": process_id, "instances": total.instances},
        )
        return Purged(total.instances, total.total, False)

    async def erase(
        self,
        business_key: str,
        variables_holding: dict[str, Any] | None,
        cancel_active: bool,
        erased_by: str,
    ) -> Erased:
        """Delete one customer's instances (by business key and/or variables) with every row of theirs,
        whatever their age, and leave one audit row that does not name the customer. Active ones are
        cancelled first with `cancel_active`; otherwise the erasure is refused naming them."""
        if not business_key and not variables_holding:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "business_key", "name the customer: a business key or variables"
            )
        if not cancel_active:
            await self._refuse_if_active(business_key, variables_holding)
        canceled = await self._cancel_active(business_key, variables_holding) if cancel_active else 0
        # Batch after batch, each picked afresh through the customer's index and deleted in its own
        # transaction: however many instances one customer has, neither memory nor a transaction grows.
        total = Deleted()
        after: uuid.UUID | None = None

        async def batch() -> int:
            nonlocal after
            async with self._engine.begin() as conn:
                found = await retention_store.matching(
                    conn, business_key, variables_holding, self._batch, after, active=False
                )
                gone = Deleted()
                if found:
                    ids = [m.id for m in found]
                    gone = await retention_store.delete_instances(conn, ids, skip_locked=False)
            total.add(gone)
            count_deleted("erase", gone.rows)
            if found:
                after = found[-1].id
            return len(found)

        await batch_after_batch(batch, self._batch)
        forgotten = Deleted()
        async with self._engine.begin() as conn:
            if business_key:
                forgotten.rows["messages"] = await retention_store.forget_buffered_messages(
                    conn, business_key
                )
            total.add(forgotten)
            audit_id = await retention_store.record_erasure(
                conn,
                erased_by,
                "business_key" if business_key else "variables",
                total.instances,
                canceled,
                total.total,
            )
        count_deleted("erase", forgotten.rows)
        # The log names neither the key nor the variables: it is personal data being let go.
        log.info(
            "customer data erased",
            extra={
                "erasure_id": audit_id,
                "erased_by": erased_by,
                "instances": total.instances,
                "rows": total.total,
            },
        )
        return Erased(total.instances, canceled, total.total, audit_id)

    async def _refuse_if_active(self, business_key: str, variables_holding: dict[str, Any] | None) -> None:
        """Refuse the erasure, deleting nothing, while some of the customer's instances run."""
        async with self._reads.connect() as conn:
            active = await retention_store.count_active_matching(conn, business_key, variables_holding)
            if not active:
                return
            first = await retention_store.matching(
                conn, business_key, variables_holding, _NAMED_ACTIVE, active=True
            )
        named = ", ".join(str(m.id) for m in first)
        more = f" and {active - len(first)} more" if active > len(first) else ""
        raise precondition(
            ErrorReason.INSTANCES_ACTIVE,
            f"{active} matching instance(s) are active: {named}{more}; cancel them first "
            "(cancel_active) or wait for them to end",
            metadata={"instance_ids": named, "active": str(active)},
        )

    async def _cancel_active(self, business_key: str, variables_holding: dict[str, Any] | None) -> int:
        """Cancel the customer's active instances, a page at a time, each in its own transaction; answers
        how many this erasure cancelled."""
        canceled = 0
        after: uuid.UUID | None = None
        while True:
            async with self._reads.connect() as conn:
                page = await retention_store.matching(
                    conn, business_key, variables_holding, self._batch, after, active=True
                )
            for found in page:
                async with self._engine.begin() as conn:
                    try:
                        await cancel_instance(conn, found.id, "erasure requested")
                        canceled += 1
                    except EngineError as error:
                        if error.reason != ErrorReason.INSTANCE_NOT_ACTIVE:  # it ended meanwhile: fine
                            raise
            if len(page) < self._batch:
                return canceled
            after = page[-1].id
