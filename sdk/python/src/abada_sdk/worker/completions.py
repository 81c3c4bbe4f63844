"""Handing finished tasks back to the engine: many in one CompleteTasks when they finish together."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import grpc
from abada.engine.v1 import external_task_pb2

from ..client import AsyncEngineClient
from ..errors import AbadaError, error_from_status


async def with_retries(
    client: AsyncEngineClient, method: Callable[[], Any], request: Any, budget: float = 10.0
) -> Any:
    """Repeats a finishing call while the engine is unreachable: it answers a repeat the same way."""
    give_up_at = time.monotonic() + budget
    delay = 0.1
    while True:
        try:
            return await client.call(method, request)
        except AbadaError as error:
            if not error.transient or time.monotonic() + delay > give_up_at:
                raise
        await asyncio.sleep(delay * random.uniform(0.8, 1.2))
        delay = min(delay * 2, 2.0)


class Completions:
    """Hands finished tasks back, many in one call when they finish together.

    The first completion goes at once, alone; those that finish while a CompleteTasks call is on its
    way wait and go together in the next one. So a quiet worker waits for nothing, and a busy one
    makes one call for many tasks instead of one each. Every task is answered on its own: the engine
    checks and finishes each as Complete would, and one refused refuses no other. A task the engine
    could not reach its database for is completed again alone, with the usual retries; an engine
    without CompleteTasks gets one Complete a task.
    """

    def __init__(self, client: AsyncEngineClient, worker_id: str) -> None:
        self._client = client
        self._worker_id = worker_id
        self._line: list[tuple[external_task_pb2.CompleteRequest, asyncio.Future[None]]] = []
        self._sender: asyncio.Task[None] | None = None
        self._batches = True

    async def complete(self, request: external_task_pb2.CompleteRequest) -> None:
        if not self._batches:
            await self._alone(request)
            return
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._line.append((request, answer))
        if self._sender is None:
            self._sender = asyncio.create_task(self._send_all())
        await asyncio.shield(answer)

    async def _alone(self, request: external_task_pb2.CompleteRequest) -> None:
        await with_retries(self._client, lambda: self._client.tasks.Complete, request)

    async def _send_all(self) -> None:
        try:
            while self._line:
                batch = self._line[:_MOST_COMPLETIONS]
                del self._line[:_MOST_COMPLETIONS]
                await self._send(batch)
        finally:
            self._sender = None

    async def _send(
        self, batch: list[tuple[external_task_pb2.CompleteRequest, asyncio.Future[None]]]
    ) -> None:
        request = external_task_pb2.CompleteTasksRequest(
            worker_id=self._worker_id, completions=[completion for completion, _ in batch]
        )
        try:
            reply = await with_retries(self._client, lambda: self._client.tasks.CompleteTasks, request)
        except AbadaError as error:
            if error.code is grpc.StatusCode.UNIMPLEMENTED:
                self._batches = False
                await asyncio.gather(*(self._answer_alone(c, answer) for c, answer in batch))
                return
            for _, answer in batch:
                answer.set_exception(error)
            return
        except BaseException as error:  # cancelled, or a bug: no caller waits forever
            for _, answer in batch:
                if isinstance(error, asyncio.CancelledError):
                    answer.cancel()
                else:
                    answer.set_exception(error)
            raise
        alone = []
        for (completion, answer), result in zip(batch, reply.results, strict=True):
            if result.HasField("completed"):
                answer.set_result(None)
                continue
            refused = error_from_status(result.refused.status, result.refused.code, result.refused.message)
            if refused.transient:
                alone.append(self._answer_alone(completion, answer))
            else:
                answer.set_exception(refused)
        await asyncio.gather(*alone)

    async def _answer_alone(
        self, request: external_task_pb2.CompleteRequest, answer: asyncio.Future[None]
    ) -> None:
        try:
            await self._alone(request)
        except Exception as error:
            answer.set_exception(error)
        else:
            answer.set_result(None)


# As many completions as the engine takes in one CompleteTasks call.
_MOST_COMPLETIONS = 100
