"""Hand-written statements sent straight through the asyncpg driver of a SQLAlchemy connection.

The store writes its statements with SQLAlchemy Core. The few every task cycle and journal step
runs are hand-written instead: SQLAlchemy's execution layer costs about as much CPU per statement
as the round trip itself, and several of them are single-statement CTEs (lock and lease, check and
insert, finish and move the token) that Core would only obscure. They go through the driver of the
same pooled connection, so inside the same transaction, if any. They keep SQLAlchemy's `:name`
parameter style, translated once to asyncpg's `$n`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import asyncpg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import SESSION_SETTINGS, autocommit, dumps

from .hot_pool import HotPool

_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")

R = TypeVar("R")
T = TypeVar("T")

# Where a hand-written statement runs: a SQLAlchemy connection (inside its transaction, if any), the
# hot statements' own pool, or an asyncpg connection.
Executor = AsyncConnection | HotPool | asyncpg.Connection


def as_many_as_given(records: str) -> str:
    """A LIMIT of its own length for a recordset read from the JSON array parameter `records`.

    The planner reckons any recordset at 100 rows. Taken at its word, it hashes all of `tasks` or
    `instances` to join a few records with them once those hold some thousands of rows (a Complete
    at 10,000 open instances took three times as long as at 100; docs/benchmarks.md), where a few
    lookups by primary key do. The LIMIT gives it the records' number when it plans for the given
    parameters, and a tenth of its guess when it plans for any."""
    return f"LIMIT jsonb_array_length(CAST({records} AS jsonb))"


# A hand-written statement is prepared once per connection (asyncpg's statement cache), but by default
# PostgreSQL still plans it again at every call for the values given, whenever that plan looks cheaper
# than the one kept for any values: with one task or one move in the call it always does. Planning
# took more of PostgreSQL's time than running did: 0.5 ms against 0.16 ms for a FetchAndLock, 0.7 ms
# against 0.3 ms for a Complete's move (pg_stat_statements, docs/benchmarks.md). Each statement here
# is written so that the plan for any values is the right one (states as literals, a recordset's
# LIMIT of its own length), and tests/engine/test_engine_plans.py holds every one of them to it. A kept
# plan follows the tables: an ANALYZE of a table drops the plans that read it, and asyncpg prepares a
# cached statement again every five minutes (its `max_cached_statement_lifetime`).
PLANNED_ONCE = {"plan_cache_mode": "force_generic_plan"}


class Row(dict[str, Any]):
    """A result row readable as `row.column`, like SQLAlchemy's rows."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HandWritten:
    """One hand-written statement; see the module docstring for why these exist."""

    def __init__(self, sql: str) -> None:
        self.names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.names:
                self.names.append(name)
            return f"${self.names.index(name) + 1}"

        self.sql = _PARAMETER.sub(number, sql)

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]

    async def fetch(self, conn: Executor, params: Mapping[str, Any]) -> list[Row]:
        driver = await _driver(conn)
        return [Row(record) for record in await driver.fetch(self.sql, *self.args(params))]

    async def fetchrow(self, conn: Executor, params: Mapping[str, Any]) -> Row | None:
        driver = await _driver(conn)
        record = await driver.fetchrow(self.sql, *self.args(params))
        return Row(record) if record is not None else None


async def _driver(conn: Executor) -> HotPool | asyncpg.Connection:
    if isinstance(conn, AsyncConnection):
        raw = await conn.get_raw_connection()
        if conn.in_transaction():
            try:
                await _begun(raw.dbapi_connection)
            except BaseException:
                # Cut off between BEGIN and the adapter's note of it (a call cancelled at its deadline),
                # the connection's transaction is unknown: it is closed, never lent again. SQLAlchemy
                # does the same with a connection its own statement was cancelled on.
                await conn.invalidate()
                raise
        # SQLAlchemy types the DBAPI's own connection as Any; under the asyncpg dialect it is asyncpg's.
        return cast(asyncpg.Connection, raw.driver_connection)
    return conn


async def _begun(adapted: Any) -> None:
    """Send the BEGIN of the caller's transaction now, if it was not sent yet.

    SQLAlchemy's asyncpg adapter sends BEGIN lazily, with the first statement it executes itself. A
    hand-written statement going first through the driver would otherwise run in autocommit: its row
    locks released at once, its writes committed even when the transaction then rolls back, and the
    statements after it in a transaction of their own. The adapter has no public call for this; its
    own (`_start_transaction`) does nothing on an autocommit connection."""
    if adapted._transaction is None:
        await adapted._start_transaction()


class HotPath:
    """Where the runtime runs hand-written statements outside a transaction of its own.

    With the hot statements' own pool (`hot_pool.py`), a statement borrows an idle asyncpg connection
    instead of SQLAlchemy's checkout, reset and checkin around the same asyncpg call; without one (a
    runtime assembled over a bare SQLAlchemy engine, as some tests do), SQLAlchemy's autocommit pool
    serves.
    """

    def __init__(self, engine: AsyncEngine, pool: HotPool | None = None) -> None:
        self._reads = autocommit(engine)
        self.pool = pool

    @contextlib.asynccontextmanager
    async def connect(self) -> AsyncIterator[Executor]:
        if self.pool is not None:
            yield self.pool
            return
        async with self._reads.connect() as conn:
            yield conn

    def batch_statement(
        self, statement: Callable[[Executor, list[T]], Awaitable[list[R]]]
    ) -> Callable[[Sequence[T]], Awaitable[list[R]]]:
        """A group commit's batch: `statement` over the whole batch, alone on a hot connection."""

        async def run(batch: Sequence[T]) -> list[R]:
            async with self.connect() as conn:
                return await statement(conn, list(batch))

        return run

    @staticmethod
    async def open_pool(url: str, size: int) -> HotPool:
        """The hot statements' pool, decoding json/jsonb as the SQLAlchemy engine does (statements pass
        JSON text), each statement planned once per connection (`PLANNED_ONCE`)."""
        return await HotPool.open(url, size, {**SESSION_SETTINGS, **PLANNED_ONCE}, _json_codecs)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


async def _json_codecs(conn: asyncpg.Connection) -> None:
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, encoder=_as_json_text, decoder=json.loads, schema="pg_catalog")


def _as_json_text(value: Any) -> str:
    return value if isinstance(value, str) else dumps(value)


def typed(cls: type[R], record: Mapping[Any, Any]) -> R:
    """A typed row from a result row: the dataclass's fields, taken by name."""
    return cls(**{name: record[name] for name in _field_names(cls)})


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names
