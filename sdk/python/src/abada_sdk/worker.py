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
import random
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from abada.engine.v1 import external_task_pb2

from .client import AsyncEngineClient
from .errors import AbadaError, LeaseLost, TaskFailed, error_from_status
from .models import Task, to_struct

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


class _Backoff:
    def __init__(self, first: float = 0.2, most: float = 10.0) -> None:
        self._first, self._most, self._next, self.failures = first, most, first, 0

    def reset(self) -> None:
        self._next, self.failures = self._first, 0

    def next_delay(self) -> float:
        delay = self._next * random.uniform(0.8, 1.2)
        self._next = min(self._next * 2, self._most)
        self.failures += 1
        return delay


class Worker:
    def __init__(
        self,
        engine: str | None = None,
        *,
        worker_id: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        concurrency: int = 8,
        poll_wait_ms: int = 10_000,
        drain_seconds: float = 20.0,
        client: AsyncEngineClient | None = None,
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
        self.client = client or AsyncEngineClient(
            engine, token=token, token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        self.concurrency = concurrency
        self.poll_wait_ms = poll_wait_ms
        self.drain_seconds = drain_seconds
        self._topics: dict[str, _Topic] = {}
        self._running: dict[str, tuple[asyncio.Task[None], Task]] = {}
        self._handing_back: set[str] = set()
        self._slot_freed = asyncio.Event()
        self._completions = _Completions(self)
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
        return len(self._running)

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
        self._stopping = asyncio.Event()
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    self._loop.add_signal_handler(signum, self._stopping.set)
        log.info(
            "worker started",
            extra={"worker_id": self.worker_id, "topics": self.topics, "concurrency": self.concurrency},
        )
        try:
            await self._poll(self._stopping)
            await self._drain()
        finally:
            if handle_signals:
                for signum in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError):
                        self._loop.remove_signal_handler(signum)
            await self.client.close()
            log.info("worker stopped", extra={"worker_id": self.worker_id})

    async def _poll(self, stopping: asyncio.Event) -> None:
        backoff = _Backoff()
        subscriptions = [
            external_task_pb2.TopicSubscription(name=t.name, lease_ms=t.lease_ms)
            for t in self._topics.values()
        ]
        while not stopping.is_set():
            if not await _first(self._wait_for_free_slot(), stopping):
                return
            request = external_task_pb2.FetchAndLockRequest(
                worker_id=self.worker_id,
                topics=subscriptions,
                max_tasks=self.concurrency - len(self._running),
                wait_ms=self.poll_wait_ms,
            )
            fetch = asyncio.ensure_future(
                self.client.call(
                    lambda: self.client.tasks.FetchAndLock,
                    request,
                    timeout=self.client.timeout + self.poll_wait_ms / 1000,
                )
            )
            if not await _first(fetch, stopping):
                return
            try:
                reply = fetch.result()
            except AbadaError as error:
                # Down, restarting or refusing us: wait and ask again; say it once, not every time.
                delay = backoff.next_delay()
                level = logging.WARNING if backoff.failures == 1 else logging.DEBUG
                log.log(level, "cannot fetch tasks: %s (retrying in %.1fs)", error, delay)
                await _sleep_unless(stopping, delay)
                continue
            if backoff.failures:
                log.info("the engine answers again")
                backoff.reset()
            for message in reply.tasks:
                self._start(message)

    async def _wait_for_free_slot(self) -> None:
        while len(self._running) >= self.concurrency:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    def _start(self, message: external_task_pb2.ExternalTask) -> None:
        task = Task.from_proto(message)
        runner = asyncio.create_task(self._execute(task, message.lease_token), name=f"abada task {task.id}")
        self._running[task.id] = (runner, task)
        runner.add_done_callback(lambda _: self._finished(task.id))

    def _finished(self, task_id: str) -> None:
        self._running.pop(task_id, None)
        self._slot_freed.set()

    async def _drain(self) -> None:
        if not self._running:
            return
        log.info("draining", extra={"running": len(self._running), "seconds": self.drain_seconds})
        await asyncio.wait([runner for runner, _ in self._running.values()], timeout=self.drain_seconds)
        for task_id, (runner, _) in list(self._running.items()):
            self._handing_back.add(task_id)
            runner.cancel()
        if self._running:
            await asyncio.wait([runner for runner, _ in self._running.values()])

    # One task

    async def _execute(self, task: Task, lease_token: str) -> None:
        topic = self._topics[task.topic]
        context = {"task_id": task.id, "topic": task.topic, "attempt": task.attempt}
        work = asyncio.ensure_future(self._call_handler(topic.handler, task))
        keeper = asyncio.create_task(self._keep_lease(task, lease_token, topic.lease_ms, work))
        try:
            variables = await work
        except asyncio.CancelledError:
            if task.id in self._handing_back:
                await self._hand_back(task, lease_token, context)
                return
            if keeper.done() and not keeper.cancelled():
                log.warning("task abandoned: its lease is gone", extra=context)
                return
            raise
        except TaskFailed as failed:
            await self._fail(task, lease_token, failed, context)
            return
        except (OSError, TimeoutError) as error:
            # Something the handler talks to is out of reach: wait it out, spending no retry.
            await self._fail(task, lease_token, _failure_of(error, "UNREACHABLE", transient=True), context)
            return
        except Exception as error:
            await self._fail(task, lease_token, _failure_of(error, "HANDLER_ERROR"), context)
            return
        finally:
            keeper.cancel()
        await self._complete(task, lease_token, variables, context)

    async def _call_handler(self, handler: Handler, task: Task) -> dict[str, Any]:
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

    async def _keep_lease(
        self, task: Task, lease_token: str, lease_ms: int, work: asyncio.Future[Any]
    ) -> None:
        """Extends the lease about every third of it; if it is lost, the handler is cancelled."""
        interval = lease_ms / 3000
        expires_at = time.monotonic() + lease_ms / 1000
        pause = interval
        while True:
            await asyncio.sleep(pause)
            asked_at = time.monotonic()
            try:
                await self._extend(task.id, lease_token, lease_ms)
            except LeaseLost as lost:
                log.warning("lease lost: %s", lost.reason, extra={"task_id": task.id})
                work.cancel()
                return
            except AbadaError as error:
                if time.monotonic() >= expires_at:
                    work.cancel()
                    return
                pause = max(0.05, min(interval / 4, (expires_at - time.monotonic()) / 2))
                log.warning("could not extend the lease, retrying: %s", error, extra={"task_id": task.id})
                continue
            expires_at = asked_at + lease_ms / 1000
            pause = interval

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
            reply = await self._with_retries(lambda: self.client.tasks.Fail, request)
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

    async def _with_retries(self, method: Callable[[], Any], request: Any, budget: float = 10.0) -> Any:
        """Repeats a finishing call while the engine is unreachable: it answers a repeat the same way."""
        give_up_at = time.monotonic() + budget
        delay = 0.1
        while True:
            try:
                return await self.client.call(method, request)
            except AbadaError as error:
                if not error.transient or time.monotonic() + delay > give_up_at:
                    raise
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, 2.0)


class _Completions:
    """Hands finished tasks back, many in one call when they finish together.

    The first completion goes at once, alone; those that finish while a CompleteTasks call is on its
    way wait and go together in the next one. So a quiet worker waits for nothing, and a busy one
    makes one call for many tasks instead of one each. Every task is answered on its own: the engine
    checks and finishes each as Complete would, and one refused refuses no other. A task the engine
    could not reach its database for is completed again alone, with the usual retries; an engine
    without CompleteTasks gets one Complete a task.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
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
        await self._worker._with_retries(lambda: self._worker.client.tasks.Complete, request)

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
        worker = self._worker
        request = external_task_pb2.CompleteTasksRequest(
            worker_id=worker.worker_id, completions=[completion for completion, _ in batch]
        )
        try:
            reply = await worker._with_retries(lambda: worker.client.tasks.CompleteTasks, request)
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


async def _first(work: Awaitable[object], stopping: asyncio.Event) -> bool:
    """Waits for `work` or `stopping`; False (and `work` cancelled) when stopping came first."""
    future = asyncio.ensure_future(work)
    stopped = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait({future, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if future in done:
        return True
    future.cancel()
    return False


async def _sleep_unless(stopping: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopping.wait(), timeout=seconds)


def _failure_of(error: Exception, code: str, *, transient: bool = False) -> TaskFailed:
    """A handler's own exception as the failure the engine is told of."""
    details = {"exception": type(error).__name__, "traceback": traceback.format_exc()[-4_000:]}
    return TaskFailed(f"{type(error).__name__}: {error}", code=code, details=details, transient=transient)
