"""Keeping the queue lean: the hot tables are vacuumed after a fixed number of dead rows.

Every lease and completion leaves a dead row version in `tasks` and a dead entry in its partial
index `tasks_fetchable`, which every FetchAndLock reads past until a vacuum removes it. PostgreSQL's
autovacuum waits for a fifth of a table to be dead by default (200,000 rows at a million tasks);
migration 0008 sets a fixed threshold per hot table, but autovacuum may be switched off or slow to
come round on a busy server. This round checks the dead rows itself and vacuums a hot table once it
passes its threshold, one replica at a time, so the queue stays as small as its open tasks.

It analyzes a hot table on another rule, autovacuum's own: after the same count of changes plus a
tenth of its rows (migration 0015). A vacuum costs what it clears; an ANALYZE samples 30,000 rows,
which at a million finished tasks is a read of the whole table. Analyzed with every vacuum, a large
history paid that read every few seconds and FetchAndLock waited behind it.
"""

from __future__ import annotations

import logging

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.store import upkeep as upkeep_store
from abada_engine.store.moves import START_REQUEST_MEMORY

log = logging.getLogger(__name__)

# Dead row versions after which a hot table is vacuumed (the same thresholds as migration 0008 gives
# autovacuum): a few seconds of a busy queue's traffic. A table is analyzed after its threshold plus
# ANALYZE_SHARE of its rows have changed.
HOT_TABLE_THRESHOLDS: dict[str, int] = {
    "tasks": 2000,
    "model_quota_usage": 1000,
    "model_quota_calls": 1000,
    "model_quota_waiters": 1000,
}
ANALYZE_SHARE = 0.1


class QueueUpkeep:
    def __init__(self, db: AsyncEngine, thresholds: dict[str, int] | None = None) -> None:
        self._db = autocommit(db)
        self._thresholds = thresholds or HOT_TABLE_THRESHOLDS

    async def round(self) -> int | None:
        """Vacuums each hot table past its threshold and analyzes each one changed enough; returns how
        many it vacuumed, or None when another replica holds the upkeep and this round did nothing."""
        async with self._db.connect() as conn:
            if not await upkeep_store.try_lock(conn):
                return None
            try:
                changes = await upkeep_store.table_changes(conn, list(self._thresholds))
                vacuumed = 0
                for table, counted in changes.items():
                    threshold = self._thresholds[table]
                    if counted.dead >= threshold:
                        await upkeep_store.vacuum(conn, table)
                        log.debug("vacuumed %s (%d dead rows)", table, counted.dead)
                        vacuumed += 1
                    if counted.changed_since_analyze >= threshold + ANALYZE_SHARE * counted.rows:
                        await upkeep_store.analyze(conn, table)
                        log.debug("analyzed %s (%d rows changed)", table, counted.changed_since_analyze)
                # Request ids of starts are remembered for a day; the older ones are let go here.
                await upkeep_store.forget_start_requests(conn, START_REQUEST_MEMORY)
                return vacuumed
            finally:
                await upkeep_store.unlock(conn)
