"""Waiting without blocking a stop: backoff between failed calls, a wait that a stop cuts short."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable


class Backoff:
    """Exponential delays with jitter: `first` seconds, doubling up to `most`; `reset` after a success."""

    def __init__(self, first: float = 0.2, most: float = 10.0) -> None:
        self._first, self._most, self._next, self.failures = first, most, first, 0

    def reset(self) -> None:
        self._next, self.failures = self._first, 0

    def next_delay(self) -> float:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self._next * 2, self._most)
        self.failures += 1
        return delay


async def first_of(work: Awaitable[object], stopping: asyncio.Event, *, cancel: bool = True) -> bool:
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


async def sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    """Sleeps `seconds`, less if `stopping` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
