"""Stopping a task at a safe point: never in the middle of a write, never starting one too late.

A write (journal STARTED, call the tool, journal COMPLETED) is a side effect: once begun it is
finished and journaled, whatever happens. Everything else (a model call, a read) may be cut off at
once; the journal makes it cheap to redo. `interrupt` cancels the task right away when it is
outside a side effect, and otherwise when the side effect ends; `side_effect` refuses to begin
once an interruption was asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from .errors import Interrupted


class TaskInterruption:
    def __init__(self) -> None:
        self._task: asyncio.Task[object] | None = None
        self._in_side_effect = False
        self._asked = asyncio.Event()
        self.reason: str | None = None
        # Set before the attempt's first journal append: from then on it has spent something and
        # ends as any attempt does; before, it can be handed back to the engine untouched.
        self.begun = False

    def bind(self, task: asyncio.Task[object]) -> None:
        self._task = task

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def interrupt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self._asked.set()
        if not self._in_side_effect and self._task is not None and not self._task.done():
            self._task.cancel(reason)

    def checkpoint(self) -> None:
        if self.reason is not None:
            raise Interrupted(self.reason)

    async def pause(self, seconds: float) -> None:
        """Waits `seconds`, less if an interruption comes meanwhile; raises Interrupted if one did."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._asked.wait(), timeout=seconds)
        self.checkpoint()

    @contextlib.contextmanager
    def side_effect(self) -> Iterator[None]:
        """Runs the block to its end; an interruption asked for meanwhile takes effect afterwards."""
        self.checkpoint()
        self._in_side_effect = True
        try:
            yield
        finally:
            self._in_side_effect = False
        self.checkpoint()
