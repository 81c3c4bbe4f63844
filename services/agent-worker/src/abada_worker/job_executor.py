"""Runs fetched tasks side by side on one event loop, keeps their leases, reports how each ended.

Each task runs in its own asyncio task next to a lease keeper. How it ended decides the report:
an answer was already handed over by the handler; AttemptFailed becomes `Fail`; a lost lease
reports nothing. An interruption at the drain deadline hands the task back (`ReleaseLease`) when
the attempt journaled nothing yet, so the next worker gets it at once; otherwise its lease lapses.
Tasks fetched while the worker was already stopping are handed back unstarted (`hand_back`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from abada.engine.v1 import external_task_pb2
from abada_common.telemetry import context_from_traceparent
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from .dependencies import TaskParked
from .engine_client import EngineClient, LeaseRef
from .errors import AttemptFailed, EngineUnavailable, Interrupted, LeaseLost
from .interruption import TaskInterruption
from .lease_keeper import keep_lease_alive
from .logs import redactor
from .task_router import TaskRouter

log = logging.getLogger(__name__)

DRAIN_DEADLINE = "drain deadline"
tracer = trace.get_tracer("abada.worker")


class JobExecutor:
    def __init__(self, engine: EngineClient, router: TaskRouter, *, lease_ms: int, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self._engine = engine
        self._router = router
        self._lease_ms = lease_ms
        self._concurrency = concurrency
        self._running: dict[str, tuple[asyncio.Task[None], TaskInterruption]] = {}
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
        interruption = TaskInterruption()
        # The attempt runs in the engine's trace for it (when tracing is on): every span and log line
        # of the task, the lease keeper's included, joins that trace.
        parent = context_from_traceparent(task.traceparent)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            runner = asyncio.create_task(self._execute(task, interruption), name=f"task {task.id}")
        finally:
            if token is not None:
                otel_context.detach(token)
        self._running[task.id] = (runner, interruption)
        runner.add_done_callback(lambda _: self._release(task.id))

    async def drain(self, deadline: float) -> None:
        """Lets running tasks finish until `deadline` (monotonic), then interrupts them at a safe point."""
        runners = [runner for runner, _ in self._running.values()]
        if runners:
            log.info(
                "draining", extra={"running": len(runners), "seconds": round(deadline - time.monotonic(), 3)}
            )
            await asyncio.wait(runners, timeout=max(0.0, deadline - time.monotonic()))
        for _, interruption in list(self._running.values()):
            interruption.interrupt(DRAIN_DEADLINE)
        # Interrupted tasks end at once, except those in a write, which finish it and journal it first.
        remaining = [runner for runner, _ in self._running.values()]
        if remaining:
            await asyncio.wait(remaining)

    async def hand_back(self, tasks: list[external_task_pb2.ExternalTask], reason: str) -> None:
        """Returns tasks this worker fetched but will not start: no failed attempt, offered again now."""
        for task in tasks:
            await self._release_lease(LeaseRef(task.id, task.lease_token, task.attempt), reason)

    async def _release_lease(self, lease: LeaseRef, reason: str) -> None:
        try:
            await self._engine.release_lease(lease, reason)
        except (LeaseLost, EngineUnavailable, AttemptFailed) as error:
            log.warning(
                "could not hand the task back; its lease will lapse",
                extra={"task_id": lease.task_id, "error": str(error)},
            )
            return
        log.info("task handed back unstarted", extra={"task_id": lease.task_id, "reason": reason})

    def _release(self, task_id: str) -> None:
        self._running.pop(task_id, None)
        if self._handed_over:
            self.submit(self._handed_over.pop(0))
            return
        self._slot_freed.set()

    async def _execute(self, task: external_task_pb2.ExternalTask, interruption: TaskInterruption) -> None:
        with tracer.start_as_current_span(
            f"task {task.topic_name}",
            kind=SpanKind.CONSUMER,
            attributes={
                "abada.task.id": task.id,
                "abada.task.attempt": task.attempt,
                "abada.node.id": task.node_id,
            },
        ):
            await self._execute_in_span(task, interruption)

    async def _execute_in_span(
        self, task: external_task_pb2.ExternalTask, interruption: TaskInterruption
    ) -> None:
        lease = LeaseRef(task.id, task.lease_token, task.attempt)
        context = {"task_id": task.id, "attempt": task.attempt}
        try:
            handler = self._router.handler_for(task)
        except AttemptFailed as failure:
            await self._report_failure(lease, failure, context)
            return
        work = asyncio.create_task(handler(task, interruption))
        interruption.bind(work)
        keeper = asyncio.create_task(
            keep_lease_alive(
                self._engine,
                lease,
                self._lease_ms,
                lambda reason: interruption.interrupt(f"lease lost: {reason}"),
            )
        )
        try:
            await asyncio.wait([work])
        finally:
            keeper.cancel()
            if not work.done():
                # The executor itself is being cancelled (hard stop): take the work down with it.
                work.cancel()
        if work.cancelled() or isinstance(work.exception(), Interrupted):
            if interruption.reason == DRAIN_DEADLINE and not interruption.begun:
                await self._release_lease(lease, "the worker is stopping")
            else:
                log.info(
                    "task interrupted; its lease will lapse", extra={**context, "reason": interruption.reason}
                )
            return
        error = work.exception()
        if error is None:
            return
        if isinstance(error, TaskParked):
            log.info("task parked until a dependency answers", extra={**context, "reason": str(error)})
        elif isinstance(error, LeaseLost):
            log.warning("task abandoned: the lease is gone", extra={**context, "reason": error.reason})
        elif isinstance(error, AttemptFailed):
            await self._report_failure(lease, error, context)
        elif isinstance(error, EngineUnavailable):
            log.error("task abandoned: the engine is unreachable", extra={**context, "error": str(error)})
        else:
            log.error("task crashed", exc_info=error, extra=context)
            await self._report_failure(
                lease, AttemptFailed("WORKER_ERROR", f"{type(error).__name__}: {error}"), context
            )

    async def _report_failure(
        self, lease: LeaseRef, failure: AttemptFailed, context: dict[str, object]
    ) -> None:
        failure.message = redactor.redact(failure.message)
        try:
            reply = await self._engine.fail(lease, failure)
        except (LeaseLost, EngineUnavailable, AttemptFailed) as error:
            log.warning(
                "could not report the failure",
                extra={**context, "error_code": failure.error_code, "error": str(error)},
            )
            return
        log.warning(
            "task failed",
            extra={
                **context,
                "error_code": failure.error_code,
                "error": failure.message,
                "will_retry": reply.will_retry,
                "incident_id": reply.incident_id,
            },
        )
