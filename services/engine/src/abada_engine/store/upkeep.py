"""The queue's upkeep: how many dead row versions the hot tables hold, and vacuuming them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import bindparam, delete, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import Text

from abada_engine.db.schema import start_requests

# One replica at a time vacuums (a session advisory lock; the number is this engine's own).
_UPKEEP_LOCK = 0x61626164_0001


@dataclass(frozen=True)
class TableChanges:
    """What PostgreSQL's statistics last counted of a table: its dead row versions, the rows changed
    since it was last analyzed, and its live rows (0 before its first vacuum or analyze)."""

    dead: int
    changed_since_analyze: int
    rows: int


_CHANGES = text(
    "SELECT s.relname, s.n_dead_tup, s.n_mod_since_analyze, greatest(c.reltuples, 0)::bigint AS live "
    "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid "
    "WHERE s.schemaname = current_schema() AND s.relname = ANY(:tables)"
)


async def table_changes(conn: AsyncConnection, tables: list[str]) -> dict[str, TableChanges]:
    rows = await conn.execute(_CHANGES.bindparams(bindparam("tables", tables, ARRAY(Text))))
    return {
        row.relname: TableChanges(int(row.n_dead_tup), int(row.n_mod_since_analyze), int(row.live))
        for row in rows
    }


_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)").bindparams(key=_UPKEEP_LOCK)
_UNLOCK = text("SELECT pg_advisory_unlock(:key)").bindparams(key=_UPKEEP_LOCK)
# The tables the upkeep may vacuum; VACUUM takes no bound table name, so each statement is written out.
VACUUMABLE = ("tasks", "model_quota_usage", "model_quota_calls", "model_quota_waiters", "dependencies")
_VACUUM = {table: text(f'VACUUM "{table}"') for table in VACUUMABLE}
_ANALYZE = {table: text(f'ANALYZE "{table}"') for table in VACUUMABLE}


async def try_lock(conn: AsyncConnection) -> bool:
    return bool((await conn.execute(_TRY_LOCK)).scalar())


async def unlock(conn: AsyncConnection) -> None:
    await conn.execute(_UNLOCK)


async def vacuum(conn: AsyncConnection, table: str) -> None:
    """VACUUM one of the engine's own hot tables (`VACUUMABLE`); `conn` must be in autocommit: VACUUM
    runs outside any transaction."""
    await conn.execute(_VACUUM[table])


async def analyze(conn: AsyncConnection, table: str) -> None:
    """ANALYZE one of the engine's own hot tables (`VACUUMABLE`)."""
    await conn.execute(_ANALYZE[table])


async def forget_start_requests(conn: AsyncConnection, older_than: timedelta, limit: int = 10_000) -> int:
    """Delete up to `limit` remembered start request ids older than `older_than`, oldest first; answers
    how many went (a short statement each round, however many piled up)."""
    oldest = (
        select(start_requests.c.request_id)
        .where(start_requests.c.created_at < func.now() - older_than)
        .order_by(start_requests.c.created_at)
        .limit(limit)
    )
    gone = await conn.execute(delete(start_requests).where(start_requests.c.request_id.in_(oldest)))
    return gone.rowcount or 0
