"""Firing due times when they pass, without polling the table, and matching buffered messages.

Each replica keeps the earliest unfired due time in memory (read from the partial index `timers_due`,
one index entry) and sleeps until it. A transaction that sets a nearer one sends its time on
`abada_timers` (store/moves.py), which wakes every replica early; one that creates a receive sends
`abada_receives`, which makes a replica look for a message buffered before it. Both also look again
every `idle_seconds`, in case a notification was lost while the LISTEN connection was away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from abada_engine.runtime.waits import FIRE_BATCH, Waits
from abada_engine.store.messages import RECEIVE_CHANNEL
from abada_engine.store.timers import TIMER_CHANNEL

from .periodic import BackgroundLoop
from .wakeups import TaskWakeups

log = logging.getLogger(__name__)

# How long due times coming thick and fast gather into one round. Short: a round's statement holds a
# core for as long as its moves take, and the calls beside it wait that long for the CPU (at 1,500
# due times a second, FetchAndLock's p99 grew more beside 200 ms rounds than beside 10 ms ones;
# docs/benchmarks.md).
_GATHER_SECONDS = 0.01


class TimerClock(BackgroundLoop):
    def __init__(
        self,
        fire: Callable[[], Awaitable[int]],
        next_due: Callable[[], Awaitable[tuple[float | None, float]]],
        batch: int,
        idle_seconds: float = 5.0,
    ) -> None:
        super().__init__("abada-timer-clock")
        self._fire = fire
        self._next_due = next_due
        self._batch = batch
        self._idle = idle_seconds
        self._wake = asyncio.Event()
        # When this replica will look next, on its own clock; and its clock's offset from the database's.
        self._sleeping_until: float = 0.0
        self._offset = 0.0

    def heard(self, payload: str) -> None:
        """A notification on `abada_timers`: the epoch seconds of a new due time ("" after a gap)."""
        try:
            due = float(payload) - self._offset
        except ValueError:
            self._wake.set()
            return
        if due < self._sleeping_until:
            self._wake.set()

    async def _run(self) -> None:
        while True:
            try:
                # Cleared before looking: a notification from here on wakes the sleep below.
                self._wake.clear()
                fired = await self._fire()
                while fired >= self._batch:
                    fired = await self._fire()
                due, now = await self._next_due()
                self._offset = now - time.time()
                sleep = self._idle if due is None else min(max(due - now, 0.0), self._idle)
                if fired and due is not None:
                    # Due times coming thick and fast: let a few gather and fire them in one round,
                    # at a few ms of lateness, rather than pay a round (three statements) for each.
                    sleep = max(sleep, _GATHER_SECONDS)
                self._sleeping_until = time.time() + sleep
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=sleep)
            except asyncio.CancelledError:
                raise
            except Exception:  # the database may be restarting; look again shortly
                log.exception("firing due times failed; retrying in 1s")
                self._sleeping_until = 0.0
                await asyncio.sleep(1.0)


class Nudged(BackgroundLoop):
    """Runs `duty` whenever nudged (coalescing nudges that arrive while it runs) and every
    `idle_seconds` regardless; `duty` returns how many it handled, and runs again while it was busy."""

    def __init__(self, name: str, duty: Callable[[], Awaitable[int]], idle_seconds: float, busy: int) -> None:
        super().__init__(name)
        self._duty = duty
        self._idle = idle_seconds
        self._busy = busy
        self._nudge = asyncio.Event()

    def nudge(self, _payload: str = "") -> None:
        self._nudge.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudge.wait(), timeout=self._idle)
            self._nudge.clear()
            try:
                while await self._duty() >= self._busy:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s failed; trying again on the next nudge", self._name)


def waiting_on_the_world(
    waits: Waits, wakeups: TaskWakeups, idle_seconds: float
) -> tuple[TimerClock, Nudged]:
    """The two loops that fire due times and match buffered messages, each listening on its channel
    (call before `wakeups.start()`); started by whichever process fires (`due_time_process.py`)."""
    clock = TimerClock(waits.fire_due, waits.next_due, FIRE_BATCH, idle_seconds)
    matcher = Nudged("message matcher", waits.correlate_buffered, idle_seconds, 100)
    wakeups.listen(TIMER_CHANNEL, clock.heard)
    wakeups.listen(RECEIVE_CHANNEL, matcher.nudge)
    return clock, matcher
