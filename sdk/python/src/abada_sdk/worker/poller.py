"""Fetches work while there is room for it, and backs off while the engine cannot be reached."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from abada.engine.v1 import external_task_pb2

from .executor import Executor
from .waiting import Backoff, first_of, sleep_unless

log = logging.getLogger("abada_sdk.worker")

# Past the poll's own wait, how long a stopping worker waits for its last long poll to answer.
HAND_BACK_MARGIN_SECONDS = 2.0

Fetch = Callable[[int], Awaitable[list[external_task_pb2.ExternalTask]]]


class Poller:
    """Long-polls with `fetch(max_tasks)` whenever the executor has a free slot and submits what comes."""

    def __init__(
        self, fetch: Fetch, executor: Executor, *, wait_ms: int, backoff: Backoff | None = None
    ) -> None:
        self._fetch = fetch
        self._executor = executor
        self._wait_ms = wait_ms
        self._backoff = backoff or Backoff()

    async def run(self, stopping: asyncio.Event) -> None:
        """Polls until `stopping` is set; a poll in flight then is let finish and its tasks handed back."""
        while not stopping.is_set():
            if not await first_of(self._executor.wait_for_free_slot(), stopping):
                return
            fetch = asyncio.ensure_future(self._fetch(self._executor.free_slots()))
            if not await first_of(fetch, stopping, cancel=False):
                await self._hand_back_late(fetch)
                return
            try:
                tasks = fetch.result()
            except Exception as error:
                # Down, restarting, or refusing us: the same answer, wait and ask again; say it once.
                delay = self._backoff.next_delay()
                level = logging.WARNING if self._backoff.failures == 1 else logging.DEBUG
                log.log(
                    level,
                    "cannot fetch tasks: %s (retrying in %.1fs)",
                    error,
                    delay,
                    extra={"error": str(error), "retry_in": round(delay, 3)},
                )
                await sleep_unless(stopping, delay)
                continue
            if self._backoff.failures:
                log.info("the engine answers again", extra={"failures": self._backoff.failures})
                self._backoff.reset()
            for task in tasks:
                self._executor.submit(task)

    async def _hand_back_late(self, fetch: asyncio.Future[list[external_task_pb2.ExternalTask]]) -> None:
        """A poll in flight when the stop came may still lock tasks: let it answer, hand them back.

        Cancelling it instead could lose tasks the engine locked just before the cancel arrived:
        they would wait out their lease. Running tasks go on meanwhile; an idle worker stops up to
        one poll's wait later.
        """
        done, _ = await asyncio.wait({fetch}, timeout=self._wait_ms / 1000 + HAND_BACK_MARGIN_SECONDS)
        if not done:
            fetch.cancel()
            return
        if fetch.cancelled() or fetch.exception() is not None:
            return
        tasks = fetch.result()
        if tasks:
            await self._executor.hand_back(tasks, "fetched while the worker was stopping")
