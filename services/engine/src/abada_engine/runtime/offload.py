"""CPU work on caller data, run off the event loop only when it can take long.

Conditions (CEL) and output-schema validation run on values a caller or a model chose, within a
time budget: in a thread, so one slow evaluation does not stall every other call. Everything else
a move does (entering a task node, rendering its inputs) is linear in data the message limit
already bounds, and cheaper than the hop itself: a thread hop costs a wake-up and, while the loop
is busy, up to a GIL switch interval (5 ms) of waiting, which halved StartInstance and Complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


async def run_cpu_work(can_take_long: bool, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`work(*args)`: in a thread when it `can_take_long`, inline otherwise."""
    if can_take_long:
        return await asyncio.to_thread(work, *args, **kwargs)
    return work(*args, **kwargs)
