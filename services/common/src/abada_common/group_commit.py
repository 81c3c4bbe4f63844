"""Group commit: requests that arrive while the previous batch is on its way go together next.

A line sends the first request at once, alone (no timer: an idle line adds no delay). Whatever arrives
while that batch is in flight waits in the line, and goes as the next batch, in order of arrival, the
moment the previous one returns. Each caller is answered on its own, with its own result, or with the
batch's exception if the batch as a whole failed — or, for a line made `each_alone_on_failure`, with
its own answer from running it again alone, so one bad request is refused on its own and the others
go through. So under load one round trip serves many callers, and the line never holds more than one
batch in flight. The engine batches its writes to PostgreSQL this way (one statement and one commit
for many calls); the agent worker, its calls to the engine (one AppendSteps for many AppendSteps).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def _read_unwanted(answer: asyncio.Future[Any]) -> None:
    if not answer.cancelled():
        answer.exception()


class GroupCommit(Generic[T, R]):
    def __init__(
        self,
        run: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        max_batch: int = 256,
        each_alone_on_failure: bool = False,
    ) -> None:
        # `run` answers one result per request, in the order given.
        self._run = run
        self._max_batch = max_batch
        self._each_alone_on_failure = each_alone_on_failure
        self._line: list[tuple[T, asyncio.Future[R]]] = []
        self._drainer: asyncio.Task[None] | None = None

    async def submit(self, request: T) -> R:
        answer: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._line.append((request, answer))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        # A caller that gives up (its RPC cancelled) leaves the batch to finish for the others.
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            # Nobody reads its answer now: a batch that fails must not log it as an exception never
            # retrieved (an engine stopping with calls in flight logged one per call).
            answer.add_done_callback(_read_unwanted)
            raise

    async def _drain(self) -> None:
        try:
            while self._line:
                batch = self._line[: self._max_batch]
                del self._line[: self._max_batch]
                failed = await self._send(batch)
                if failed and self._each_alone_on_failure and len(batch) > 1:
                    for one in batch:
                        await self._send([one])
        except asyncio.CancelledError:
            for _, answer in self._line:
                answer.cancel()
            self._line.clear()
            raise
        finally:
            self._drainer = None

    async def _send(self, batch: list[tuple[T, asyncio.Future[R]]]) -> bool:
        """Run one batch and answer its callers; True when it failed as a whole (and was not answered,
        if each request is to be tried alone then)."""
        try:
            results = await self._run([request for request, _ in batch])
        except BaseException as error:
            if isinstance(error, asyncio.CancelledError):
                for _, answer in batch:
                    answer.cancel()
                raise
            if not (self._each_alone_on_failure and len(batch) > 1):
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(error)
            return True
        for (_, answer), result in zip(batch, results, strict=True):
            if not answer.done():
                answer.set_result(result)
        return False
