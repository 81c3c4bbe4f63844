"""`Worker`: serves external-task topics with plain Python handlers.

    worker = Worker(worker_id="notifier", token_file="worker.token")

    @worker.task("notify")
    async def notify(task: Task) -> dict:
        return {"notified": True}

    worker.run()

For every fetched task the worker runs its topic's handler (async handlers on the loop, plain
functions in a thread), keeps the lease alive meanwhile, and then completes the task with the
returned variables, or fails it: `TaskFailed(retry=False)` raises an incident at once;
`TaskFailed(transient=True)`, a connection error or a timeout waits with backoff without spending a
retry (until the node's outage budget runs out); any other exception lets the engine retry with
backoff until the node's retries run out. At most
`concurrency` tasks run at once. If the engine goes away the worker waits and asks again. On
SIGTERM or SIGINT it fetches nothing more, lets running handlers finish for `drain_seconds`, then
hands the rest back so another worker takes them over at once, without counting a failed attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Unpack

import grpc
from abada.engine.v1 import external_task_pb2

from ..client import AsyncEngineClient
from ..connection import ConnectionOptions
from ..errors import AbadaError, LeaseLost, TaskFailed
from ..models import Task, to_struct
from .completions import Completions, with_retries
from .executor import Executor
from .lease_keeper import Renewal, keep_lease_alive
from .poller import Poller

log = logging.getLogger("abada_sdk.worker")

Handler = Callable[[Task], Awaitable[dict[str, Any] | None]] | Callable[[Task], dict[str, Any] | None]

DEFAULT_LEASE_MS = 30_000
# The shortest lease the engine grants: extending to it hands a task back on an engine that has no
# ReleaseLease yet.
_SHORTEST_LEASE_MS = 1_000
_MESSAGE_LIMIT = 10_000


@dataclass(frozen=True)
class _Topic:
    name: str
    handler: Handler
    lease_ms: int


class Worker:
    def __init__(
        self,
        engine: str | None = None,
        *,
        worker_id: str | None = None,
        concurrency: int = 8,
        poll_wait_ms: int = 10_000,
        drain_seconds: float = 20.0,
        client: AsyncEngineClient | None = None,
        **connection: Unpack[ConnectionOptions],
    ) -> None:
        """`engine`, `token`/`token_file` and `worker_id` default to ABADA_ENGINE_ADDRESS,
        ABADA_TOKEN / ABADA_TOKEN_FILE and ABADA_WORKER_ID. The worker id must be the token's
        identity, or start with it and a slash (`notifier/pod-1`)."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        chosen_id = worker_id or os.environ.get("ABADA_WORKER_ID")
        if not chosen_id:
            raise ValueError("a worker needs a worker_id (or ABADA_WORKER_ID): its identity at the engine")
        self.worker_id = chosen_id
        self.client = client or AsyncEngineClient(engine, **connection)
        self.concurrency = concurrency
        self.poll_wait_ms = poll_wait_ms
        self.drain_seconds = drain_seconds
        self._topics: dict[str, _Topic] = {}
        self._executor: Executor | None = None
        self._completions = Completions(self.client, self.worker_id)
        self._stopping: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # Registration

    def task(self, topic: str, *, lease_ms: int = DEFAULT_LEASE_MS) -> Callable[[Handler], Handler]:
        """Registers the decorated function as the handler of `topic`."""

        def register(handler: Handler) -> Handler:
            self.add_handler(topic, handler, lease_ms=lease_ms)
            return handler

        return register

    def add_handler(self, topic: str, handler: Handler, *, lease_ms: int = DEFAULT_LEASE_MS) -> None:
        if topic in self._topics:
            raise ValueError(f"topic {topic!r} already has a handler")
        self._topics[topic] = _Topic(topic, handler, lease_ms)

    @property
    def topics(self) -> list[str]:
        return list(self._topics)

    @property
    def running(self) -> int:
        return 0 if self._executor is None else self._executor.running

    # Running

    def run(self) -> None:
        """Serves until SIGTERM or SIGINT, then drains and hands back what is left."""
        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        asyncio.run(self.serve())

    def stop(self) -> None:
        """Asks a serving worker to drain and stop; safe from any thread or a signal handler."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def serve(self, *, handle_signals: bool = True) -> None:
        if not self._topics:
            raise ValueError("no handlers: register one with @worker.task(topic)")
        self._loop = asyncio.get_running_loop()
        self._stopping = stopping = asyncio.Event()
        executor = self._executor = Executor(
            self._run_for, self._hand_back_unstarted, concurrency=self.concurrency
        )
        poller = Poller(self._fetch, executor, wait_ms=self.poll_wait_ms)
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    self._loop.add_signal_handler(signum, stopping.set)
        log.info(
            "worker started",
            extra={"worker_id": self.worker_id, "topics": self.topics, "concurrency": self.concurrency},
        )
        try:
            await poller.run(stopping)
            await executor.drain(time.monotonic() + self.drain_seconds)
        finally:
            if handle_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError):
                        self._loop.remove_signal_handler(signum)
            await self.client.close()
            log.info("worker stopped", extra={"worker_id": self.worker_id})

    async def _fetch(self, max_tasks: int) -> list[external_task_pb2.ExternalTask]:
        request = external_task_pb2.FetchAndLockRequest(
            worker_id=self.worker_id,
            topics=[
                external_task_pb2.TopicSubscription(name=t.name, lease_ms=t.lease_ms)
                for t in self._topics.values()
            ],
            max_tasks=max_tasks,
            wait_ms=self.poll_wait_ms,
        )
        reply = await self.client.call(
            lambda: self.client.tasks.FetchAndLock,
            request,
            timeout=self.client.timeout + self.poll_wait_ms / 1000,
        )
        return list(reply.tasks)

    def _run_for(self, message: external_task_pb2.ExternalTask) -> _HandlerRun:
        return _HandlerRun(self, Task.from_proto(message), message.lease_token)

    async def _hand_back_unstarted(self, message: external_task_pb2.ExternalTask, reason: str) -> None:
        await self._hand_back(Task.from_proto(message), message.lease_token, {"task_id": message.id})

    # Reports

    async def _extend(self, task_id: str, lease_token: str, lease_ms: int) -> None:
        await self.client.call(
            lambda: self.client.tasks.ExtendLease,
            external_task_pb2.ExtendLeaseRequest(
                task_id=task_id, worker_id=self.worker_id, lease_token=lease_token, lease_ms=lease_ms
            ),
        )

    async def _complete(
        self, task: Task, lease_token: str, variables: dict[str, Any], context: dict[str, Any]
    ) -> None:
        request = external_task_pb2.CompleteRequest(
            task_id=task.id, worker_id=self.worker_id, lease_token=lease_token, variables=to_struct(variables)
        )
        try:
            await self._completions.complete(request)
        except AbadaError as error:
            log.error("could not complete the task: %s", error, extra=context)
            return
        log.info("task completed", extra=context)

    async def _fail(self, task: Task, lease_token: str, failed: TaskFailed, context: dict[str, Any]) -> None:
        request = external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id=self.worker_id,
            lease_token=lease_token,
            error_code=failed.code,
            error_message=failed.message[:_MESSAGE_LIMIT],
            error_details=to_struct(failed.details),
            no_retry=not failed.retry,
            transient=failed.transient,
            retry_after_ms=int((failed.retry_after_seconds or 0) * 1000),
        )
        try:
            reply = await with_retries(self.client, lambda: self.client.tasks.Fail, request)
        except AbadaError as error:
            log.error("could not report the failure: %s", error, extra=context)
            return
        log.warning(
            "task waits out an outage: %s" if failed.transient and reply.will_retry else "task failed: %s",
            failed.message,
            extra={
                **context,
                "error_code": failed.code,
                "will_retry": reply.will_retry,
                "incident_id": reply.incident_id,
            },
        )

    async def _hand_back(self, task: Task, lease_token: str, context: dict[str, Any]) -> None:
        """Gives the task up for another worker at once, without counting a failed attempt."""
        try:
            if await self._release(task.id, lease_token):
                log.info("task handed back", extra=context)
                return
            # An engine without ReleaseLease: shorten the lease to the minimum instead, so the task
            # is offered again a second from now, still without a failed attempt.
            await self._extend(task.id, lease_token, _SHORTEST_LEASE_MS)
        except AbadaError as error:
            log.warning("could not hand the task back; its lease will lapse: %s", error, extra=context)
            return
        log.info("task handed back", extra=context)

    async def _release(self, task_id: str, lease_token: str) -> bool:
        """ReleaseLease where the engine (and these stubs) have it; False where they do not."""
        request_type = getattr(external_task_pb2, "ReleaseLeaseRequest", None)
        if request_type is None or not hasattr(self.client.tasks, "ReleaseLease"):
            return False
        request = request_type(
            task_id=task_id, worker_id=self.worker_id, lease_token=lease_token, reason="worker stopping"
        )
        try:
            await self.client.call(lambda: self.client.tasks.ReleaseLease, request)
        except AbadaError as error:
            if error.code is grpc.StatusCode.UNIMPLEMENTED:
                return False
            raise
        return True


class _HandlerRun:
    """One task in the hands of its topic's handler, its lease kept alive meanwhile."""

    def __init__(self, worker: Worker, task: Task, lease_token: str) -> None:
        self._worker = worker
        self._task = task
        self._lease_token = lease_token
        self._work: asyncio.Future[dict[str, Any]] | None = None
        self._handing_back = False

    def stop(self, reason: str) -> None:
        # At the drain deadline a handler is cut off and its task handed back for another worker.
        self._handing_back = True
        if self._work is not None:
            self._work.cancel()

    async def run(self) -> None:
        worker, task, lease_token = self._worker, self._task, self._lease_token
        topic = worker._topics[task.topic]
        context = {"task_id": task.id, "topic": task.topic, "attempt": task.attempt}
        if self._handing_back:  # stopped before it began
            await worker._hand_back(task, lease_token, context)
            return
        work = self._work = asyncio.ensure_future(_call_handler(topic.handler, task))
        lost: list[str] = []

        def lease_lost(reason: str) -> None:
            lost.append(reason)
            work.cancel()

        keeper = asyncio.create_task(
            keep_lease_alive(
                lambda: worker._extend(task.id, lease_token, topic.lease_ms),
                topic.lease_ms,
                lease_lost,
                classify=_renewal_of,
                task_id=task.id,
            )
        )
        try:
            variables = await work
        except asyncio.CancelledError:
            if self._handing_back:
                await worker._hand_back(task, lease_token, context)
                return
            if lost:
                log.warning("task abandoned: its lease is gone", extra=context)
                return
            raise
        except TaskFailed as failed:
            await worker._fail(task, lease_token, failed, context)
            return
        except (OSError, TimeoutError) as error:
            # Something the handler talks to is out of reach: wait it out, spending no retry.
            await worker._fail(task, lease_token, _failure_of(error, "UNREACHABLE", transient=True), context)
            return
        except Exception as error:
            await worker._fail(task, lease_token, _failure_of(error, "HANDLER_ERROR"), context)
            return
        finally:
            keeper.cancel()
        await worker._complete(task, lease_token, variables, context)


async def _call_handler(handler: Handler, task: Task) -> dict[str, Any]:
    if inspect.iscoroutinefunction(handler):
        result = await handler(task)
    else:
        result = await asyncio.to_thread(handler, task)
        if inspect.isawaitable(result):
            result = await result
    if result is None:
        return {}
    if not isinstance(result, dict):
        raise TypeError(f"a handler returns a dict of variables or None, not {type(result).__name__}")
    return result


def _renewal_of(error: Exception) -> tuple[Renewal, str]:
    if isinstance(error, LeaseLost):
        return Renewal.LOST, error.reason or "LEASE_LOST"
    if isinstance(error, AbadaError) and error.transient:
        return Renewal.UNREACHABLE, ""
    if isinstance(error, AbadaError):
        return Renewal.REFUSED, ""
    raise error


def _failure_of(error: Exception, code: str, *, transient: bool = False) -> TaskFailed:
    """A handler's own exception as the failure the engine is told of."""
    details = {"exception": type(error).__name__, "traceback": traceback.format_exc()[-4_000:]}
    return TaskFailed(f"{type(error).__name__}: {error}", code=code, details=details, transient=transient)
