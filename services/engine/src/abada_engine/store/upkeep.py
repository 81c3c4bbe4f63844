"""The queue's upkeep: how many dead row versions the hot tables hold, and vacuuming them."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import bindparam, delete, func, select, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.types import Text

from abada_engine.db.schema import start_requests

# One replica at a time vacuums (a session advisory lock; the number is this engine's own).
_UPKEEP_LOCK = 0x61626164_0001


async def dead_rows(conn: AsyncConnection, tables: list[str]) -> dict[str, int]:
    """Dead row versions per table, as PostgreSQL's statistics last counted them."""
    rows = await conn.execute(
        text(
            "SELECT relname, n_dead_tup FROM pg_stat_user_tables "
            "WHERE schemaname = current_schema() AND relname = ANY(:tables)"
        ).bindparams(bindparam("tables", tables, ARRAY(Text)))
    )
    return {row.relname: int(row.n_dead_tup) for row in rows}


_TRY_LOCK = text("SELECT pg_try_advisory_lock(:key)").bindparams(key=_UPKEEP_LOCK)
_UNLOCK = text("SELECT pg_advisory_unlock(:key)").bindparams(key=_UPKEEP_LOCK)
# The tables the upkeep may vacuum; VACUUM takes no bound table name, so each statement is written out.
VACUUMABLE = ("tasks", "model_quota_usage", "model_quota_calls", "model_quota_waiters", "dependencies")
_VACUUM = {table: text(f'VACUUM (ANALYZE) "{table}"') for table in VACUUMABLE}


async def try_lock(conn: AsyncConnection) -> bool:
    return bool((await conn.execute(_TRY_LOCK)).scalar())


async def unlock(conn: AsyncConnection) -> None:
    await conn.execute(_UNLOCK)


async def vacuum(conn: AsyncConnection, table: str) -> None:
    """VACUUM (ANALYZE) one of the engine's own hot tables (`VACUUMABLE`); `conn` must be in
    autocommit: VACUUM runs outside any transaction."""
    await conn.execute(_VACUUM[table])


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
