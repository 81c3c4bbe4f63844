"""One fetched task's attempt in the agent worker: its topic's handler, its lease kept, its end reported.

The SDK's worker parts run these (abada_sdk.worker: the poller fetches, the executor holds the slots
and the drain deadline, keep_lease_alive renews). How a run ended decides the report: an answer was
already handed over by the handler; AttemptFailed becomes `Fail`; a lost lease reports nothing. An
interruption at the drain deadline hands the task back (`ReleaseLease`) when the attempt journaled
nothing yet, so the next worker gets it at once; otherwise its lease lapses.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from abada.engine.v1 import external_task_pb2
from abada_common.telemetry import context_from_traceparent
from abada_sdk.worker import DRAIN_DEADLINE, Renewal, keep_lease_alive
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from .dependencies import TaskParked
from .engine_client import EngineClient, LeaseRef
from .errors import AttemptFailed, EngineUnavailable, Interrupted, LeaseLost
from .interruption import TaskInterruption
from .logs import redactor
from .metrics import LEASE_RENEWALS

log = logging.getLogger(__name__)
tracer = trace.get_tracer("abada.worker")

TaskHandler = Callable[[external_task_pb2.ExternalTask, TaskInterruption], Coroutine[Any, Any, None]]


class AgentRuns:
    """Starts a run per fetched task and hands back the tasks fetched but never started."""

    def __init__(self, engine: EngineClient, handlers: Mapping[str, TaskHandler], *, lease_ms: int) -> None:
        self.engine = engine
        self.handlers = dict(handlers)
        self.lease_ms = lease_ms

    @property
    def topics(self) -> list[str]:
        return list(self.handlers)

    def start(self, task: external_task_pb2.ExternalTask) -> AgentRun:
        return AgentRun(self, task)

    async def release(self, task: external_task_pb2.ExternalTask, reason: str) -> None:
        """Gives a task back unstarted: no failed attempt, offered again at once."""
        await release_lease(self.engine, LeaseRef(task.id, task.lease_token, task.attempt), reason)


class AgentRun:
    def __init__(self, runs: AgentRuns, task: external_task_pb2.ExternalTask) -> None:
        self._runs = runs
        self._task = task
        self._interruption = TaskInterruption()

    def stop(self, reason: str) -> None:
        # Interrupted tasks end at once, except those in a write, which finish it and journal it first.
        self._interruption.interrupt(reason)

    async def run(self) -> None:
        task = self._task
        # The attempt runs in the engine's trace for it (when tracing is on): every span and log line
        # of the task, the lease keeper's included, joins that trace.
        parent = context_from_traceparent(task.traceparent)
        token = otel_context.attach(parent) if parent is not None else None
        try:
            with tracer.start_as_current_span(
                f"task {task.topic_name}",
                kind=SpanKind.CONSUMER,
                attributes={
                    "abada.task.id": task.id,
                    "abada.task.attempt": task.attempt,
                    "abada.node.id": task.node_id,
                },
            ):
                await self._run_in_span()
        finally:
            if token is not None:
                otel_context.detach(token)

    async def _run_in_span(self) -> None:
        task, interruption, engine = self._task, self._interruption, self._runs.engine
        lease = LeaseRef(task.id, task.lease_token, task.attempt)
        context = {"task_id": task.id, "attempt": task.attempt}
        handler = self._runs.handlers.get(task.topic_name)
        if handler is None:
            failure = AttemptFailed("NO_HANDLER", f"this worker has no handler for topic {task.topic_name!r}")
            await report_failure(engine, lease, failure, context)
            return
        if interruption.requested:  # stopped before it began
            await release_lease(engine, lease, "the worker is stopping")
            return
        work = asyncio.create_task(handler(task, interruption))
        interruption.bind(work)
        lease_ms = self._runs.lease_ms
        keeper = asyncio.create_task(
            keep_lease_alive(
                lambda: engine.extend_lease(lease, lease_ms),
                lease_ms,
                lambda reason: interruption.interrupt(f"lease lost: {reason}"),
                classify=_renewal_of,
                task_id=task.id,
                on_renewal=_count_renewal,
            )
        )
        try:
            await asyncio.wait([work])
        finally:
            keeper.cancel()
            if not work.done():
                # The run itself is being cancelled (hard stop): take the work down with it.
                work.cancel()
        if work.cancelled() or isinstance(work.exception(), Interrupted):
            if interruption.reason == DRAIN_DEADLINE and not interruption.begun:
                await release_lease(engine, lease, "the worker is stopping")
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
            await report_failure(engine, lease, error, context)
        elif isinstance(error, EngineUnavailable):
            log.error("task abandoned: the engine is unreachable", extra={**context, "error": str(error)})
        else:
            log.error("task crashed", exc_info=error, extra=context)
            await report_failure(
                engine, lease, AttemptFailed("WORKER_ERROR", f"{type(error).__name__}: {error}"), context
            )


async def release_lease(engine: EngineClient, lease: LeaseRef, reason: str) -> None:
    try:
        await engine.release_lease(lease, reason)
    except (LeaseLost, EngineUnavailable, AttemptFailed) as error:
        log.warning(
            "could not hand the task back; its lease will lapse",
            extra={"task_id": lease.task_id, "error": str(error)},
        )
        return
    log.info("task handed back unstarted", extra={"task_id": lease.task_id, "reason": reason})


async def report_failure(
    engine: EngineClient, lease: LeaseRef, failure: AttemptFailed, context: dict[str, object]
) -> None:
    failure.message = redactor.redact(failure.message)
    try:
        reply = await engine.fail(lease, failure)
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


def _renewal_of(error: Exception) -> tuple[Renewal, str]:
    if isinstance(error, LeaseLost):
        return Renewal.LOST, error.reason
    if isinstance(error, EngineUnavailable):
        return Renewal.UNREACHABLE, ""
    if isinstance(error, AttemptFailed):
        return Renewal.REFUSED, ""
    raise error


def _count_renewal(outcome: Renewal) -> None:
    label = {Renewal.RENEWED: "ok", Renewal.LOST: "lost"}.get(outcome, "failed")
    LEASE_RENEWALS.labels(label).inc()
