"""A budget of work and time for one check on caller data, spent as the check goes and stopped there.

An output schema is evaluated against a value a worker or a model chose. Even with linear keywords,
a schema can multiply work (`anyOf` over `$ref`s that branch again) and a value can be as large as
the message limit: a check must not run for as long as its inputs make it. Each keyword evaluated is
charged one step; past `max_steps`, past the deadline, or once whoever waits for the answer has gone
away (`cancel`), the next charge raises `WorkBudgetSpent` inside the check, so the thread doing it
stops there instead of running on unseen.

The budget in force belongs to the thread doing the work (`spending`); with none in force, charging
is free and nothing stops (deploy-time checks on the deployer's own schema).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class WorkBudgetSpent(Exception):
    """The check used up its budget (`why` says which part) and was stopped."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class WorkBudget:
    def __init__(
        self,
        max_steps: int,
        max_seconds: float,
        *,
        spent: type[Exception] = WorkBudgetSpent,
        yield_every: int = 0,
    ) -> None:
        self._spent = spent
        self._yield_every = yield_every
        self.max_steps = max_steps
        self.max_seconds = max_seconds
        self.steps = 0
        self._deadline = time.monotonic() + max_seconds
        self._cancelled = False

    def restart(self) -> None:
        """The time budget counts from now (work queued for a thread starts its clock when it runs)."""
        self._deadline = time.monotonic() + self.max_seconds

    def cancel(self) -> None:
        """Nobody waits for the answer any more: the work stops at its next charge."""
        self._cancelled = True

    def charge(self, steps: int = 1) -> None:
        self.steps += steps
        if self._yield_every and self.steps % self._yield_every == 0:
            # Work on a thread beside an event loop lets the loop have the GIL now and then, rather
            # than every switch interval (5 ms) for each of the loop's wake-ups.
            time.sleep(0)
        if self._cancelled:
            raise self._spent("its caller went away")
        if self.steps > self.max_steps:
            raise self._spent(f"it took more than {self.max_steps} steps")
        if time.monotonic() > self._deadline:
            raise self._spent(f"it took longer than {self.max_seconds:g} s")


_current = threading.local()


@contextmanager
def spending(budget: WorkBudget) -> Iterator[WorkBudget]:
    """Make `budget` the one charged by work this thread does inside the block."""
    before = getattr(_current, "budget", None)
    _current.budget = budget
    try:
        yield budget
    finally:
        _current.budget = before


def charge(steps: int = 1) -> None:
    """Charge the budget in force on this thread, if any."""
    budget: WorkBudget | None = getattr(_current, "budget", None)
    if budget is not None:
        budget.charge(steps)
