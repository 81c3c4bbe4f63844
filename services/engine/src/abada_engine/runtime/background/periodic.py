"""Running the engine's background duties: loops started and stopped with it, and rounds run every
few seconds (the reapers, the dependency probes, the queue upkeep, retention, batches, fan-out ends)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class BackgroundLoop:
    """A loop of the engine's own (`_run`) started with it and cancelled when it stops."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        raise NotImplementedError


class Periodic(BackgroundLoop):
    """Calls `duty` every `interval` seconds until stopped; a failing round is logged, not fatal. A duty
    answers how many it handled, or None when another replica had the round's work."""

    def __init__(self, name: str, duty: Callable[[], Awaitable[int | None]], interval: float) -> None:
        super().__init__(name)
        self._duty = duty
        self._interval = interval

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                done = await self._duty()
                if done:
                    log.info("%s: %d handled", self._name, done)
            except asyncio.CancelledError:
                raise
            except Exception:  # the database may be restarting; the next round tries again
                log.exception("%s failed; retrying in %.1fs", self._name, self._interval)
