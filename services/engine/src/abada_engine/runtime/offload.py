"""CPU work on caller data: bounded in work and time, and off the event loop when it can take long.

Conditions (CEL) and output-schema validation run on values a caller or a model chose. Three things
keep one caller's costly value from stalling every other caller:

- a budget per piece of work (`WorkBudget`: steps and seconds), spent inside the check itself, so the
  thread doing it stops at the limit, or as soon as the caller that waits for it goes away;
- a dedicated executor with `CPU_WORKERS` threads and at most `MAX_WAITING` pieces of work admitted
  at once (beyond that the caller is told to come back: ENGINE_BUSY), never the default executor,
  which the rest of the process shares and whose threads run on after their caller gave up;
- a check that is usually small (`inline_steps`) is tried inline first with a small step budget: a
  `{"ok": true}` against a simple schema never waits behind someone's 4,000-item list in the pool.

Everything else a move does (entering a task node, rendering its inputs) is linear in data the
message limit already bounds, and cheaper than the hop itself: a thread hop costs a wake-up and,
while the loop is busy, up to a GIL switch interval (5 ms) of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.definitions.work_budget import WorkBudget, WorkBudgetSpent, spending
from abada_engine.errors import Category, EngineError

P = ParamSpec("P")
R = TypeVar("R")

CPU_WORKERS = 2
MAX_WAITING = 64
# A check on one value: generous for any real output (1 MB of JSON against a real schema is well
# under a million keyword evaluations), small beside a gRPC deadline.
WORK_STEPS = 5_000_000
WORK_SECONDS = 2.0
# How often work on the executor gives the event loop the GIL (a few hundred microseconds of work).
YIELD_EVERY_STEPS = 64
# The inline attempt: a few milliseconds of work at most.
INLINE_SECONDS = 0.005

# Converting, checking and storing a large value (hundreds of KB) is tens of milliseconds of work on
# the event loop besides the check itself: at most this many large values are worked on at once, the
# others wait their turn without spending anything, so the loop stays free for everyone else.
LARGE_VALUE_BYTES = 32_768
LARGE_VALUES_AT_ONCE = 2
_large_values: asyncio.Semaphore | None = None


@contextlib.asynccontextmanager
async def large_value_turn(size_bytes: int) -> AsyncIterator[None]:
    """Wait for a turn when a caller's value is large (`LARGE_VALUE_BYTES`), then hold it."""
    global _large_values
    if size_bytes < LARGE_VALUE_BYTES:
        yield
        return
    if _large_values is None:
        _large_values = asyncio.Semaphore(LARGE_VALUES_AT_ONCE)
    async with _large_values:
        yield


_executor = ThreadPoolExecutor(max_workers=CPU_WORKERS, thread_name_prefix="abada-cpu-work")
_admitted = 0


class _TooMuchForInline(Exception):
    """The inline attempt ran past its small budget: the work moves to the executor."""


async def run_cpu_work(can_take_long: bool, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`work(*args)`: inline when it cannot take long, else in the bounded executor under a budget."""
    if not can_take_long:
        return work(*args, **kwargs)
    return await _run_in_executor(functools.partial(work, *args, **kwargs))


async def run_cpu_check(
    can_take_long: bool, inline_steps: int, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs
) -> R:
    """As `run_cpu_work`, but work that can take long is first tried inline on `inline_steps` steps
    (the work must be free of side effects: it may be run again in the executor); 0 skips that try."""
    if can_take_long and inline_steps > 0:
        try:
            return _run_inline(inline_steps, work, *args, **kwargs)
        except _TooMuchForInline:
            pass
    return await run_cpu_work(can_take_long, work, *args, **kwargs)


def _run_inline(steps: int, work: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    budget = WorkBudget(steps, INLINE_SECONDS, spent=_TooMuchForInline)
    with spending(budget):
        return work(*args, **kwargs)


async def _run_in_executor(work: Callable[[], R]) -> R:
    global _admitted
    if _admitted >= MAX_WAITING:
        raise EngineError(
            Category.RESOURCE_EXHAUSTED,
            ErrorReason.ENGINE_BUSY,
            f"{MAX_WAITING} costly checks are already running or waiting on this engine; try again",
            retry_after_seconds=1.0,
        )
    budget = WorkBudget(WORK_STEPS, WORK_SECONDS, yield_every=YIELD_EVERY_STEPS)

    def run() -> R:
        budget.restart()  # the time budget counts from when a thread takes the work
        with spending(budget):
            return work()

    _admitted += 1
    try:
        future = asyncio.get_running_loop().run_in_executor(_executor, run)
        try:
            return await future
        except asyncio.CancelledError:
            budget.cancel()  # the thread stops at its next charge instead of finishing for nobody
            raise
    finally:
        _admitted -= 1


__all__ = ["WorkBudgetSpent", "large_value_turn", "run_cpu_check", "run_cpu_work"]
