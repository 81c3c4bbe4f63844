"""Runs fetched tasks side by side on one event loop, at most `concurrency` at once.

What one task's run is belongs to the worker (the SDK's handlers, the agent loop); the executor owns
the slots, starts tasks handed over in a Complete's answer in the slot the completing task frees,
stops every run at the drain deadline, and hands back tasks fetched but never started.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from abada.engine.v1 import external_task_pb2

log = logging.getLogger("abada_sdk.worker")

DRAIN_DEADLINE = "drain deadline"


class TaskRun(Protocol):
    """One task's attempt as the worker runs it."""

    async def run(self) -> None:
        """Works the task to its end and reports it (complete, fail, hand back); never raises."""
        ...

    def stop(self, reason: str) -> None:
        """Asks the run to end at its next safe point (the drain deadline has come)."""
        ...


StartRun = Callable[[external_task_pb2.ExternalTask], TaskRun]
# Gives a fetched task back unstarted: no failed attempt, offered again at once.
Release = Callable[[external_task_pb2.ExternalTask, str], Awaitable[None]]


class Executor:
    def __init__(self, start: StartRun, release: Release, *, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._start = start
        self._release = release
        self._concurrency = concurrency
        self._running: dict[str, tuple[asyncio.Task[None], TaskRun]] = {}
        self._slot_freed = asyncio.Event()
        # Tasks that came in the answer to a Complete, waiting for the completing task's slot.
        self._handed_over: list[external_task_pb2.ExternalTask] = []

    @property
    def running(self) -> int:
        return len(self._running)

    def free_slots(self) -> int:
        return self._concurrency - len(self._running)

    async def wait_for_free_slot(self) -> None:
        while self.free_slots() <= 0:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def hand_over(self, task: external_task_pb2.ExternalTask) -> None:
        """A task handed over in a Complete's answer: it starts in the slot the completing task frees."""
        self._handed_over.append(task)

    def submit(self, task: external_task_pb2.ExternalTask) -> None:
        run = self._start(task)
        runner = asyncio.create_task(run.run(), name=f"task {task.id}")
        self._running[task.id] = (runner, run)
        runner.add_done_callback(lambda _: self._finished(task.id))

    async def drain(self, deadline: float) -> None:
        """Lets running tasks finish until `deadline` (monotonic), then stops each at a safe point."""
        runners = [runner for runner, _ in self._running.values()]
        if runners:
            log.info(
                "draining",
                extra={"running": len(runners), "seconds": round(deadline - time.monotonic(), 3)},
            )
            await asyncio.wait(runners, timeout=max(0.0, deadline - time.monotonic()))
        for _, run in list(self._running.values()):
            run.stop(DRAIN_DEADLINE)
        remaining = [runner for runner, _ in self._running.values()]
        if remaining:
            await asyncio.wait(remaining)

    async def hand_back(self, tasks: list[external_task_pb2.ExternalTask], reason: str) -> None:
        """Returns tasks this worker fetched but will not start."""
        for task in tasks:
            await self._release(task, reason)

    def _finished(self, task_id: str) -> None:
        self._running.pop(task_id, None)
        if self._handed_over:
            self.submit(self._handed_over.pop(0))
            return
        self._slot_freed.set()
