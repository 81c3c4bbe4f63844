"""Waking long-polling fetchers when work arrives, through PostgreSQL LISTEN/NOTIFY (and hearing
the engine's other announcements, such as a dependency's circuit changing, on the same connection).

Every transaction that creates a fetchable task sends `pg_notify('abada_tasks', topic)`;
PostgreSQL delivers it on commit to every engine replica, so a fetcher waiting on
any replica wakes at once instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import asyncpg

from abada_engine.store.tasks import TASK_CHANNEL

log = logging.getLogger(__name__)

_UNHEARD_RECHECK_SECONDS = 0.5
# A wake-up lost to a slow reconnect costs a long poll its promptness: reconnect at least every second.
_MAX_RECONNECT_SECONDS = 1.0


class TaskWakeups:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        # Other channels heard on the same connection: channel -> what to call with each payload.
        self._channels: dict[str, Callable[[str], None]] = {}
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._connection: asyncpg.Connection | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._listening = asyncio.Event()

    def listen(self, channel: str, on_payload: Callable[[str], None]) -> None:
        """Also hear `channel` (before `start`); `on_payload("")` after any gap in listening, when
        notifications may have been lost."""
        self._channels[channel] = on_payload

    async def start(self) -> None:
        self._supervisor = asyncio.create_task(self._keep_listening(), name="abada-task-wakeups")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._listening.wait(), timeout=10)

    async def stop(self) -> None:
        if self._supervisor:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        if self._connection is not None and not self._connection.is_closed():
            await self._connection.close()

    async def wait(self, topics: Iterable[str], timeout: float) -> bool:
        """Wait until work is announced on one of `topics`, or `timeout` seconds pass."""
        if not self._listening.is_set():
            # Not listening (the database is away, or LISTEN is reconnecting): notifications would be
            # lost, so the caller looks again soon instead of trusting a wake-up.
            timeout = min(timeout, _UNHEARD_RECHECK_SECONDS)
        event = asyncio.Event()
        topics = list(topics)
        for topic in topics:
            self._waiters[topic].add(event)
        try:
            await asyncio.wait_for(event.wait(), timeout=max(timeout, 0))
            return True
        except TimeoutError:
            return False
        finally:
            for topic in topics:
                self._waiters[topic].discard(event)
                if not self._waiters[topic]:
                    del self._waiters[topic]

    def _on_notify(self, con_ref: Any, pid: int, channel: str, payload: object) -> None:
        # asyncpg's listener signature; the payload is the topic that has work.
        for event in list(self._waiters.get(str(payload), ())):
            event.set()

    def _wake_everyone(self) -> None:
        for events in list(self._waiters.values()):
            for event in list(events):
                event.set()

    async def _keep_listening(self) -> None:
        delay = 0.2
        while True:
            try:
                self._connection = await asyncpg.connect(self._dsn)
                await self._connection.add_listener(TASK_CHANNEL, self._on_notify)
                for channel, on_payload in self._channels.items():
                    await self._connection.add_listener(channel, _payload_to(on_payload))
                    on_payload("")
                self._listening.set()
                delay = 0.2
                # Notifications sent while we were not listening are lost: let every waiter re-check.
                self._wake_everyone()
                closed = asyncio.Event()
                self._connection.add_termination_listener(lambda _c, closed=closed: closed.set())
                await closed.wait()
                log.warning("the LISTEN connection closed; reconnecting")
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the database may be restarting; keep trying
                log.warning("cannot LISTEN for new tasks (%s); retrying in %.1fs", error, delay)
            self._listening.clear()
            self._wake_everyone()
            for on_payload in self._channels.values():
                on_payload("")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_RECONNECT_SECONDS)


def _payload_to(on_payload: Callable[[str], None]) -> Callable[[Any, int, str, object], None]:
    def listener(con_ref: Any, pid: int, channel: str, payload: object) -> None:
        on_payload(str(payload))

    return listener
