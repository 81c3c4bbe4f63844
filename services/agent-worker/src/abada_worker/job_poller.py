"""Fetches work while there is room for it, and backs off while the engine cannot be reached."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable

from abada.engine.v1 import external_task_pb2

from .engine_client import EngineClient
from .job_executor import JobExecutor

log = logging.getLogger(__name__)

# Past the poll's own wait, how long a stopping worker waits for its last long poll to answer.
HAND_BACK_MARGIN_SECONDS = 2.0


class Backoff:
    def __init__(self, first_seconds: float = 0.2, max_seconds: float = 10.0) -> None:
        self._first = first_seconds
        self._max = max_seconds
        self._next = first_seconds
        self.failures = 0

    def reset(self) -> None:
        self._next = self._first
        self.failures = 0

    def next_delay(self) -> float:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self._next * 2, self._max)
        self.failures += 1
        return delay


class JobPoller:
    def __init__(
        self,
        engine: EngineClient,
        executor: JobExecutor,
        *,
        topic: str,
        lease_ms: int,
        wait_ms: int = 10_000,
        backoff: Backoff | None = None,
    ) -> None:
        self._engine = engine
        self._executor = executor
        self._topic = topic
        self._lease_ms = lease_ms
        self._wait_ms = wait_ms
        self._backoff = backoff or Backoff()

    async def run(self, stopping: asyncio.Event) -> None:
        """Polls until `stopping` is set; a poll in flight is abandoned then, not waited for."""
        while not stopping.is_set():
            if not await _first(self._executor.wait_for_free_slot(), stopping):
                return
            fetch = asyncio.create_task(
                self._engine.fetch_and_lock(
                    self._topic, self._lease_ms, self._executor.free_slots(), self._wait_ms
                )
            )
            if not await _first(fetch, stopping, cancel=False):
                await self._hand_back_late(fetch)
                return
            try:
                tasks = fetch.result()
            except Exception as error:
                # Down, restarting, or refusing us: the same answer, wait and ask again.
                delay = self._backoff.next_delay()
                level = logging.WARNING if self._backoff.failures == 1 else logging.DEBUG
                log.log(
                    level,
                    "cannot fetch work from the engine",
                    extra={"error": str(error), "retry_in": round(delay, 3)},
                )
                await _sleep_unless(stopping, delay)
                continue
            if self._backoff.failures:
                log.info("the engine answers again", extra={"failures": self._backoff.failures})
                self._backoff.reset()
            for task in tasks:
                self._executor.submit(task)

    async def _hand_back_late(self, fetch: asyncio.Task[list[external_task_pb2.ExternalTask]]) -> None:
        """A poll in flight when the stop came may still lock tasks: let it answer, hand them back.

        Cancelling it instead could lose tasks the engine locked just before the cancel arrived:
        they would wait out their lease. Running tasks go on meanwhile; an idle worker stops up to
        one poll's wait later.
        """
        tasks = await _settled(fetch, self._wait_ms / 1000 + HAND_BACK_MARGIN_SECONDS)
        if tasks:
            await self._executor.hand_back(tasks, "fetched while the worker was stopping")


async def _settled(
    fetch: asyncio.Task[list[external_task_pb2.ExternalTask]], seconds: float
) -> list[external_task_pb2.ExternalTask]:
    done, _ = await asyncio.wait({fetch}, timeout=seconds)
    if not done:
        fetch.cancel()
        return []
    if fetch.cancelled() or fetch.exception() is not None:
        return []
    return fetch.result()


async def _first(work: Awaitable[object], stopping: asyncio.Event, *, cancel: bool = True) -> bool:
    """Waits for `work` or for `stopping`; False (and `work` cancelled, if `cancel`) when stopping came first."""
    future = asyncio.ensure_future(work)
    stopped = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait({future, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if future in done:
        return True
    if cancel:
        future.cancel()
    return False


async def _sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
    except TimeoutError:
        pass
