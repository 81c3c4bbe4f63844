"""`EngineClient`: the same API as AsyncEngineClient for code without an event loop.

One private event loop runs in a daemon thread; each method hands its coroutine to it and waits.
So there is one implementation of every call, and the sync client works from any thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar, Unpack, overload

import grpc
from abada.engine.v1 import dependency_pb2, incident_pb2, queue_pb2

from .client import AsyncEngineClient, InstanceHandle, Stubs
from .connection import Connection, ConnectionOptions
from .models import (
    Approval,
    ApprovalState,
    Definition,
    Deployment,
    HistoryEvent,
    Incident,
    Instance,
    InstanceState,
    JournalStep,
    Resolution,
    UserTask,
)

Result = TypeVar("Result")
Reply = TypeVar("Reply")


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

    @property
    def id(self) -> str:
        return self._handle.id

    def refresh(self) -> Instance:
        return self._runner.run(self._handle.refresh())

    def result(self, timeout: float | None = None, *, stop_on_incident: bool = True) -> Instance:
        return self._runner.run(self._handle.result(timeout, stop_on_incident=stop_on_incident))


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

    def deploy(self, bundle: str | os.PathLike[str], *, source_name: str | None = None) -> Deployment:
        return self._runner.run(self._async.deploy(bundle, source_name=source_name))

    def definitions(self, process_id: str = "") -> list[Definition]:
        return self._runner.run(self._async.definitions(process_id))

    @overload
    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        business_key: str = "",
        version: int = 0,
        wait: Literal[False] = False,
        timeout: float | None = None,
    ) -> SyncInstanceHandle: ...

    @overload
    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        business_key: str = "",
        version: int = 0,
        wait: Literal[True],
        timeout: float | None = None,
    ) -> Instance: ...

    def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        business_key: str = "",
        version: int = 0,
        wait: bool = False,
        timeout: float | None = None,
    ) -> SyncInstanceHandle | Instance:
        handle = self._runner.run(
            self._async.start(process_id, variables, business_key=business_key, version=version)
        )
        synced = SyncInstanceHandle(self._runner, handle)
        return synced.result(timeout) if wait else synced

    def get(self, instance_id: str) -> Instance:
        return self._runner.run(self._async.get(instance_id))

    def history(self, instance_id: str) -> list[HistoryEvent]:
        return self._runner.run(self._async.history(instance_id))

    def list_instances(
        self, process_id: str = "", state: InstanceState | None = None, limit: int = 100
    ) -> list[Instance]:
        return self._runner.run(self._async.list_instances(process_id, state, limit))

    def cancel(self, instance_id: str, reason: str = "") -> Instance:
        return self._runner.run(self._async.cancel(instance_id, reason))

    def wait(
        self, instance_id: str, timeout: float | None = None, *, stop_on_incident: bool = True
    ) -> Instance:
        return self._runner.run(self._async.wait(instance_id, timeout, stop_on_incident=stop_on_incident))

    def incidents(
        self, *, instance_id: str = "", include_resolved: bool = False, type: str = ""
    ) -> list[Incident]:
        return self._runner.run(
            self._async.incidents(instance_id=instance_id, include_resolved=include_resolved, type=type)
        )

    def resolve_incident(
        self,
        incident_id: str,
        resolution: Resolution,
        *,
        result: dict[str, Any] | None = None,
        comment: str = "",
    ) -> Incident:
        return self._runner.run(
            self._async.resolve_incident(incident_id, resolution, result=result, comment=comment)
        )

    def user_tasks(self, instance_id: str = "") -> list[UserTask]:
        return self._runner.run(self._async.user_tasks(instance_id))

    def complete_user_task(self, user_task_id: str, variables: dict[str, Any] | None = None) -> Instance:
        return self._runner.run(self._async.complete_user_task(user_task_id, variables))

    def list_approvals(
        self,
        *,
        process_id: str = "",
        business_key: str = "",
        tool_ref: str = "",
        state: ApprovalState = ApprovalState.PENDING,
    ) -> list[Approval]:
        return self._runner.run(
            self._async.list_approvals(
                process_id=process_id, business_key=business_key, tool_ref=tool_ref, state=state
            )
        )

    def get_approval(self, approval_id: str) -> Approval:
        return self._runner.run(self._async.get_approval(approval_id))

    def approve(
        self, approval_id: str, *, arguments: dict[str, Any] | None = None, comment: str = ""
    ) -> Approval:
        return self._runner.run(self._async.approve(approval_id, arguments=arguments, comment=comment))

    def reject(self, approval_id: str, reason: str) -> Approval:
        return self._runner.run(self._async.reject(approval_id, reason))

    def journal(self, task_id: str) -> list[JournalStep]:
        return self._runner.run(self._async.journal(task_id))

    def resolve_incidents(
        self,
        type: str,
        resolution: Resolution,
        *,
        dependency: dependency_pb2.Dependency | None = None,
        process_id: str = "",
        comment: str = "",
    ) -> incident_pb2.ResolveIncidentsResponse:
        return self._runner.run(
            self._async.resolve_incidents(
                type, resolution, dependency=dependency, process_id=process_id, comment=comment
            )
        )

    def topics(self) -> queue_pb2.ListTopicsResponse:
        return self._runner.run(self._async.topics())

    def dependencies(self) -> list[dependency_pb2.DependencyStatus]:
        return self._runner.run(self._async.dependencies())
