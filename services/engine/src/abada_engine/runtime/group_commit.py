"""Group commit: requests that arrive while the previous batch is in the database go together next.

A line sends the first request at once, alone (no timer: an idle line adds no delay). Whatever arrives
while that batch is in flight waits in the line, and goes as the next batch, in order of arrival, the
moment the previous one returns. Each caller is answered on its own, with its own result, or with the
batch's exception if the batch as a whole failed. So under load one round trip serves many callers,
and the line never holds more than one batch in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    def __init__(self, run: Callable[[Sequence[T]], Awaitable[Sequence[R]]], max_batch: int = 256) -> None:
        # `run` answers one result per request, in the order given.
        self._run = run
        self._max_batch = max_batch
        self._line: list[tuple[T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, request: T) -> R:
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._line.append((request, answer))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        # A caller that gives up (its RPC cancelled) leaves the batch to finish for the others.
        return await asyncio.shield(answer)

    async def _drain(self) -> None:
        try:
            while self._line:
                batch = self._line[: self._max_batch]
                del self._line[: self._max_batch]
                try:
                    results = await self._run([request for request, _ in batch])
                except BaseException as error:
                    for _, answer in batch:
                        if not answer.done():
                            answer.set_exception(error)
                    if isinstance(error, asyncio.CancelledError):
                        raise
                    continue
                for (_, answer), result in zip(batch, results, strict=True):
                    if not answer.done():
                        answer.set_result(result)
        except asyncio.CancelledError:
            for _, answer in self._line:
                answer.cancel()
            self._line.clear()
            raise
        finally:
            self._drainer = None
