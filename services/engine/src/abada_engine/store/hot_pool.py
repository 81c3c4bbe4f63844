"""The hot statements' own connections: a pool that does nothing but lend a connection for one statement.

asyncpg's pool costs about 22 µs of the engine's CPU around every statement (its acquire context,
timeout scope, holder bookkeeping and inactivity timer), as much as a tenth of what an AppendStep
costs the engine in all. The hot statements need none of that: each is one statement in autocommit,
leaving no session state behind. So a statement takes an idle connection (or opens one, up to the
size, or waits for one) and gives it back after; a connection that failed with anything but
PostgreSQL refusing the statement itself (a lost connection, a terminated backend, a cancelled
statement) is closed and forgotten, and the next statement that finds none idle opens a new one.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import asyncpg

R = TypeVar("R")

# SQLSTATE classes after which a connection is not lent again: connection exception, operator
# intervention (a terminated backend, a shutdown), system error, internal error.
_SESSION_OVER = frozenset({"08", "57", "58", "XX"})


class HotPool:
    def __init__(
        self,
        url: str,
        size: int,
        server_settings: Mapping[str, str],
        init: Callable[[asyncpg.Connection], Awaitable[None]],
    ) -> None:
        self._url = url
        self._size = size
        self._server_settings = dict(server_settings)
        self._init = init
        self._idle: list[asyncpg.Connection] = []
        self._waiting: collections.deque[asyncio.Future[asyncpg.Connection | None]] = collections.deque()
        # Connections open or being opened, idle or lent.
        self._count = 0
        self._closed = False

    @classmethod
    async def open(
        cls,
        url: str,
        size: int,
        server_settings: Mapping[str, str],
        init: Callable[[asyncpg.Connection], Awaitable[None]],
    ) -> HotPool:
        """A pool with one connection open already: an engine that cannot reach its database says so
        when it starts, not at its first call."""
        pool = cls(url, size, server_settings, init)
        pool._give_back(await pool._connect())
        return pool

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        connection = await self._take()
        return await self._run(connection, connection.fetch(sql, *args))

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        connection = await self._take()
        return await self._run(connection, connection.fetchrow(sql, *args))

    async def _run(self, connection: asyncpg.Connection, statement: Awaitable[R]) -> R:
        try:
            result = await statement
        except asyncpg.PostgresError as error:
            # PostgreSQL refused the statement: the connection is as good as before, unless the error
            # is about the connection or the server (its session ended, the server is shutting down).
            if (error.sqlstate or "")[:2] in _SESSION_OVER:
                self._forget(connection)
            else:
                self._give_back(connection)
            raise
        except BaseException:
            self._forget(connection)
            raise
        self._give_back(connection)
        return result

    async def _take(self) -> asyncpg.Connection:
        while True:
            while self._idle:
                idle = self._idle.pop()
                if not idle.is_closed():
                    return idle
                self._forget(idle)  # closed while idle: the server ended its session
            if self._closed:
                raise asyncpg.InterfaceError("the engine's hot connection pool is closed")
            if self._count < self._size:
                return await self._connect()
            # None: a place came free without a connection (one was lost): look again.
            waiter: asyncio.Future[asyncpg.Connection | None] = asyncio.get_running_loop().create_future()
            self._waiting.append(waiter)
            try:
                handed_over = await waiter
            except asyncio.CancelledError:
                handed = waiter.result() if waiter.done() and not waiter.cancelled() else None
                if handed is not None:
                    self._give_back(handed)  # handed over just as the caller gave up
                else:
                    self._wake_a_waiter(None)  # pass on the turn this caller was woken for, if any
                raise
            if handed_over is not None:
                return handed_over

    async def _connect(self) -> asyncpg.Connection:
        self._count += 1
        try:
            connection = await asyncpg.connect(self._url, server_settings=self._server_settings)
            await self._init(connection)
        except BaseException:
            self._count -= 1
            self._wake_a_waiter(None)
            raise
        return connection

    def _give_back(self, connection: asyncpg.Connection) -> None:
        if self._closed or connection.is_closed():
            self._forget(connection)
        elif not self._wake_a_waiter(connection):
            self._idle.append(connection)

    def _forget(self, connection: asyncpg.Connection) -> None:
        connection.terminate()
        self._count -= 1
        self._wake_a_waiter(None)

    def _wake_a_waiter(self, connection: asyncpg.Connection | None) -> bool:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return True
        return False

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            self._count -= 1
            await connection.close()
        while self._wake_a_waiter(None):
            pass  # each wakes to find the pool closed
