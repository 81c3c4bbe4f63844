"""`EngineClient`: the same API as AsyncEngineClient for code without an event loop.

One private event loop runs in a daemon thread; each method hands its coroutine to it and waits.
So there is one implementation of every call, and the sync client works from any thread.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, Unpack, overload

import grpc

from . import requests
from .client import AsyncEngineClient, InstanceHandle, Stubs
from .connection import Connection, ConnectionOptions
from .models import Instance

Result = TypeVar("Result")
Reply = TypeVar("Reply")
P = ParamSpec("P")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="abada-sdk-loop", daemon=True)
        self._thread.start()

    def run(self, work: Coroutine[Any, Any, Result]) -> Result:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class SyncInstanceHandle:
    def __init__(self, runner: _LoopThread, handle: InstanceHandle) -> None:
        self._runner = runner
        self._handle = handle
        self.started = handle.started
        self.already_started = handle.already_started

    @property
    def id(self) -> str:
        return self._handle.id

    def refresh(self) -> Instance:
        return self._runner.run(self._handle.refresh())

    def result(self, timeout: float | None = None, *, stop_on_incident: bool = True) -> Instance:
        return self._runner.run(self._handle.result(timeout, stop_on_incident=stop_on_incident))


def _blocking(
    method: Callable[Concatenate[AsyncEngineClient, P], Coroutine[Any, Any, Result]],
) -> Callable[Concatenate[EngineClient, P], Result]:
    """AsyncEngineClient's `method` as a blocking one: run on the client's loop thread and waited for.
    Same parameters, same answer, same errors; written once, in the async client."""

    @functools.wraps(method)
    def blocking(self: EngineClient, /, *args: P.args, **kwargs: P.kwargs) -> Result:
        return self._runner.run(method(self._async, *args, **kwargs))

    return blocking


class EngineClient:
    """Blocking twin of AsyncEngineClient; use as `with EngineClient(...) as client:`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        connection: Connection | None = None,
        **options: Unpack[ConnectionOptions],
    ) -> None:
        self._async = AsyncEngineClient(address, connection=connection, **options)
        self.connection = self._async.connection
        self._runner = _LoopThread()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._async.close())
        self._runner.stop()

    def call(
        self,
        method: Callable[[Stubs], grpc.aio.UnaryUnaryMultiCallable[Any, Reply]],
        request: Any,
        timeout: float | None = None,
    ) -> Reply:
        """One RPC the typed methods do not cover, answered with the engine's own reply message:
        `client.call(lambda stubs: stubs.queue.ListTasks, request)`. A refusal raises an AbadaError."""
        # The stubs are reached inside the coroutine: the channel must be opened on the loop's thread.
        return self._runner.run(self._async.call(lambda: method(self._async.stubs), request, timeout))

    @overload
    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: Literal[False] = False,
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> SyncInstanceHandle: ...

    @overload
    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: Literal[True],
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> Instance: ...

    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> SyncInstanceHandle | Instance:
        handle = self._runner.run(self._async.start(process_id, variables, **options))
        synced = SyncInstanceHandle(self._runner, handle)
        return synced.result(timeout) if wait else synced

    deploy = _blocking(AsyncEngineClient.deploy)
    definitions = _blocking(AsyncEngineClient.definitions)
    get = _blocking(AsyncEngineClient.get)
    history = _blocking(AsyncEngineClient.history)
    list_instances = _blocking(AsyncEngineClient.list_instances)
    publish = _blocking(AsyncEngineClient.publish)
    cancel = _blocking(AsyncEngineClient.cancel)
    purge = _blocking(AsyncEngineClient.purge)
    erase = _blocking(AsyncEngineClient.erase)
    modify = _blocking(AsyncEngineClient.modify)
    migrate = _blocking(AsyncEngineClient.migrate)
    create_batch = _blocking(AsyncEngineClient.create_batch)
    batches = _blocking(AsyncEngineClient.batches)
    batch = _blocking(AsyncEngineClient.batch)
    pause_batch = _blocking(AsyncEngineClient.pause_batch)
    resume_batch = _blocking(AsyncEngineClient.resume_batch)
    cancel_batch = _blocking(AsyncEngineClient.cancel_batch)
    wait = _blocking(AsyncEngineClient.wait)
    incidents = _blocking(AsyncEngineClient.incidents)
    resolve_incident = _blocking(AsyncEngineClient.resolve_incident)
    resolve_incidents = _blocking(AsyncEngineClient.resolve_incidents)
    user_tasks = _blocking(AsyncEngineClient.user_tasks)
    complete_user_task = _blocking(AsyncEngineClient.complete_user_task)
    list_approvals = _blocking(AsyncEngineClient.list_approvals)
    get_approval = _blocking(AsyncEngineClient.get_approval)
    approve = _blocking(AsyncEngineClient.approve)
    reject = _blocking(AsyncEngineClient.reject)
    journal = _blocking(AsyncEngineClient.journal)
    topics = _blocking(AsyncEngineClient.topics)
    dependencies = _blocking(AsyncEngineClient.dependencies)
