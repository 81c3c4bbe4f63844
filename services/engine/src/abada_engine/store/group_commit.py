"""Group commit: writes that arrive together share one statement and one commit.

On a busy engine many callers write the same kind of row at once (every StartInstance inserts an
instance, its first task and its history). One statement and one commit per caller costs PostgreSQL
a transaction each and the engine a round trip each; sharing them costs one for the group. The
group forms by itself, with no timer: the first write goes out alone at once, and what arrives
while a group is being written waits for the next one. An idle engine answers as fast as before;
a busy one writes bigger groups.

Each caller still gets its own answer: when a group's statement fails, its writes are retried one
by one, so one bad write is refused on its own and the others go through.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """Writes items through `write_group`, which takes a list and answers one result per item, in order."""

    def __init__(
        self, write_group: Callable[[list[T]], Awaitable[list[R]]], max_group: int = 64, writers: int = 2
    ) -> None:
        self._write_group = write_group
        self._max_group = max_group
        self._writers = writers
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def write(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # Writers start with the first write, in the loop that serves it (a new loop, as in
            # tests that reuse an engine across loops, gets its own).
            self._loop, self._ready = loop, asyncio.Event()
            self._tasks = [loop.create_task(self._writer()) for _ in range(self._writers)]
        future: asyncio.Future[R] = loop.create_future()
        self._waiting.append((item, future))
        self._ready.set()
        return await future

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks, self._loop = [], None
        waiting, self._waiting = self._waiting, []
        for _, future in waiting:
            _settle(future, error=RuntimeError("the engine is shutting down"))

    async def _writer(self) -> None:
        while True:
            await self._ready.wait()
            group = self._waiting[: self._max_group]
            del self._waiting[: self._max_group]
            if not self._waiting:
                self._ready.clear()
            group = [(item, future) for item, future in group if not future.done()]
            if group:
                await self._write(group)

    async def _write(self, group: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._write_group([item for item, _ in group])
        except Exception as error:
            if len(group) == 1:
                _settle(group[0][1], error=error)
                return
            for one in group:  # each refused (or written) on its own
                await self._write([one])
            return
        for (_, future), result in zip(group, results, strict=True):
            _settle(future, result=result)


def _settle(future: asyncio.Future[R], result: R | None = None, error: Exception | None = None) -> None:
    if future.done():  # its caller gave up (cancelled): nobody to answer
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
