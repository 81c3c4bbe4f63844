"""The hot statements' pool: bounded, lends each connection to one statement at a time, and replaces a
connection it lost instead of lending it again."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from abada_engine.db.database import plain_url
from abada_engine.db.outage import database_unreachable
from abada_engine.store.hand_written import HotPath


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
