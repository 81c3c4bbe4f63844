"""The hot statements' pool: bounded, lends each connection to one statement at a time, and replaces a
connection it lost instead of lending it again."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from abada_engine.db.database import plain_url
from abada_engine.db.outage import database_unreachable
from abada_engine.store.hand_written import HandWritten, HotPath
from sqlalchemy import Text, func, select


@pytest.fixture
async def pool(database_url: str):
    opened = await HotPath.open_pool(plain_url(database_url), 2)
    yield opened
    await opened.close()


async def backend(pool) -> int:
    row = await pool.fetchrow("SELECT pg_backend_pid() AS pid, pg_sleep(0.05)")
    return row["pid"]


async def test_statements_beyond_the_size_wait_for_a_connection_and_all_run(pool):
    pids = await asyncio.gather(*(backend(pool) for _ in range(8)))
    assert len(set(pids)) <= 2


async def test_a_refusal_from_postgresql_keeps_the_connection(pool):
    before = await backend(pool)
    with pytest.raises(asyncpg.DivisionByZeroError):
        await pool.fetchrow("SELECT 1 / 0")
    assert await backend(pool) == before


async def test_a_lost_connection_is_replaced_not_lent_again(pool, database_url: str):
    lost = await backend(pool)
    admin = await asyncpg.connect(plain_url(database_url))
    try:
        await admin.execute("SELECT pg_terminate_backend($1)", lost)
    finally:
        await admin.close()
    try:
        await pool.fetchrow("SELECT 1")
    except Exception as error:
        # The statement that meets the lost connection may fail (asyncpg says so in several ways);
        # its caller is told the database was out of reach (UNAVAILABLE: send it again), not INTERNAL.
        assert database_unreachable(error), repr(error)
    pids = await asyncio.gather(*(backend(pool) for _ in range(4)))
    assert lost not in pids
    assert len(set(pids)) <= 2


async def test_a_cancelled_statement_leaves_the_pool_whole(pool):
    slow = asyncio.ensure_future(pool.fetchrow("SELECT pg_sleep(5)"))
    await asyncio.sleep(0.2)
    slow.cancel()
    with pytest.raises(asyncio.CancelledError):
        await slow
    # Its connection was closed rather than lent again mid-statement; both places serve again.
    pids = await asyncio.gather(*(backend(pool) for _ in range(4)))
    assert len(set(pids)) <= 2


TRANSACTION_ID = HandWritten("SELECT pg_current_xact_id()::text AS xid")


async def test_a_hand_written_statement_first_in_a_transaction_runs_inside_it(db) -> None:
    """SQLAlchemy begins its transaction with the first statement it sends itself: a hand-written one
    sent before it must not run in autocommit, outside the transaction and its rollback."""
    async with db.connect() as conn, conn.begin():
        first = await TRANSACTION_ID.fetchrow(conn, {})
        then = (await conn.execute(select(func.pg_current_xact_id().cast(Text)))).scalar_one()
        assert first is not None and first["xid"] == then
    async with db.connect() as conn:
        await conn.begin()
        await HandWritten("CREATE TEMP TABLE kept_only_if_committed (n int)").fetch(conn, {})
        await conn.rollback()
        kept = await HandWritten("SELECT to_regclass('pg_temp.kept_only_if_committed') AS name").fetchrow(
            conn, {}
        )
        assert kept is not None and kept["name"] is None


async def test_a_call_cancelled_at_its_begin_never_lends_its_connection_again(db, monkeypatch) -> None:
    """Cancelled between sending BEGIN and the adapter's note of it, a connection would go back to the
    pool inside a transaction nobody ends, its row locks held for whoever borrows it next."""
    async with db.connect() as conn:
        adapted = (await conn.get_raw_connection()).dbapi_connection
        cut_off_pid = adapted.driver_connection.get_server_pid()

        async def begin_then_cancelled(self: object) -> None:
            await adapted.driver_connection.execute("BEGIN")
            raise asyncio.CancelledError

        monkeypatch.setattr(type(adapted), "_start_transaction", begin_then_cancelled)
        await conn.begin()
        with pytest.raises(asyncio.CancelledError):
            await TRANSACTION_ID.fetchrow(conn, {})
        monkeypatch.undo()
        assert conn.invalidated
    async with db.connect() as conn:
        raw = await conn.get_raw_connection()
        assert raw.driver_connection.get_server_pid() != cut_off_pid
        assert not raw.driver_connection.is_in_transaction()
