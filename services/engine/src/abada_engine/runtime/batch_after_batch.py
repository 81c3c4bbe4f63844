"""Working through a backlog in batches, each its own short transaction, so nothing is held for long."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def batch_after_batch(
    batch: Callable[[], Awaitable[int]],
    size: int,
    *,
    most: int | None = None,
    for_seconds: float | None = None,
    pause_seconds: float = 0.0,
) -> int:
    """Run `batch` (it takes up to `size` and answers how many it took) again while it takes a whole
    one: a shorter batch says nothing is left. `most` batches or `for_seconds` bound a round of a
    background job, which yields to the next round; `pause_seconds` between two batches leaves room
    for the hot path. Answers how many the batches took in all."""
    ends = None if for_seconds is None else time.monotonic() + for_seconds
    taken = 0
    batches = 0
    while True:
        took = await batch()
        taken += took
        batches += 1
        if took < size or batches == most or (ends is not None and time.monotonic() >= ends):
            return taken
        if pause_seconds:
            await asyncio.sleep(pause_seconds)
