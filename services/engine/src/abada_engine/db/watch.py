"""Whether PostgreSQL answers, asked once a second, for the health endpoints.

Probes (Kubernetes, load balancers) read `grpc.health.v1` and `/healthz`: while the database is out
of reach the engine can do nothing useful, so both say NOT_SERVING, and SERVING again once a
`SELECT 1` goes through. A statement that meets a lost connection also reports it at once
(`report_unreachable`), so a probe does not wait for the next round to hear of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from .outage import database_unreachable

log = logging.getLogger(__name__)

Listener = Callable[[bool], None]


class DatabaseWatch:
    def __init__(
        self, engine: AsyncEngine, interval_seconds: float = 1.0, timeout_seconds: float = 2.0
    ) -> None:
        self._engine = engine
        self._interval = interval_seconds
        self._timeout = timeout_seconds
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self.reachable = True

    def subscribe(self, listener: Listener) -> None:
        """`listener(reachable)` now and on every change."""
        self._listeners.append(listener)
        listener(self.reachable)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="abada-database-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def report_unreachable(self) -> None:
        self._set(False)

    async def probe(self) -> bool:
        try:
            async with asyncio.timeout(self._timeout):
                async with self._engine.connect() as conn:
                    await conn.execute(text("SELECT 1"))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # any failure to answer SELECT 1 is "not reachable" to a probe
            if not database_unreachable(error) and not isinstance(error, TimeoutError):
                log.warning("the database health probe failed: %s", type(error).__name__)
            return False
        return True

    async def _run(self) -> None:
        while True:
            self._set(await self.probe())
            await asyncio.sleep(self._interval)

    def _set(self, reachable: bool) -> None:
        if reachable == self.reachable:
            return
        self.reachable = reachable
        if reachable:
            log.info("the database answers again")
        else:
            log.warning("the database is unreachable: health is NOT_SERVING")
        for listener in self._listeners:
            listener(reachable)
