"""`AsyncEngineClient`: the engine's operator API as typed async methods, errors as SDK exceptions."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar, Unpack, overload

import grpc
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    batch_pb2,
    batch_pb2_grpc,
    definition_pb2_grpc,
    dependency_pb2,
    dependency_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    incident_pb2,
    incident_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
)

from . import requests
from .connection import Connection, ConnectionOptions
from .errors import AbadaError, InstanceFailed, error_from_rpc
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
    Publication,
    Resolution,
    UserTask,
)

Reply = TypeVar("Reply")
# The engine caps a page at 500; full pages keep long listings to a few round trips.
_PAGE_SIZE = 500
# The largest page of the lists that returned everything before they paged (incidents, approvals, ...).
_LONG_PAGE_SIZE = 1000
_FIRST_POLL_SECONDS = 0.1
_MAX_POLL_SECONDS = 1.0


@dataclass(frozen=True)
class Stubs:
    """The engine's services over one channel, for `call`: `client.call(lambda: client.stubs.queue.ListTopics, ...)`."""

    definitions: definition_pb2_grpc.DefinitionServiceAsyncStub
    processes: process_pb2_grpc.ProcessServiceAsyncStub
    tasks: external_task_pb2_grpc.ExternalTaskServiceAsyncStub
    incidents: incident_pb2_grpc.IncidentServiceAsyncStub
    approvals: approval_pb2_grpc.ApprovalServiceAsyncStub
    queue: queue_pb2_grpc.QueueServiceAsyncStub
    dependencies: dependency_pb2_grpc.DependencyServiceAsyncStub
    batches: batch_pb2_grpc.BatchServiceAsyncStub

    @classmethod
    def over(cls, channel: grpc.aio.Channel) -> Stubs:
        return cls(
            definitions=definition_pb2_grpc.DefinitionServiceStub(channel),
            processes=process_pb2_grpc.ProcessServiceStub(channel),
            tasks=external_task_pb2_grpc.ExternalTaskServiceStub(channel),
            incidents=incident_pb2_grpc.IncidentServiceStub(channel),
            approvals=approval_pb2_grpc.ApprovalServiceStub(channel),
            queue=queue_pb2_grpc.QueueServiceStub(channel),
            dependencies=dependency_pb2_grpc.DependencyServiceStub(channel),
            batches=batch_pb2_grpc.BatchServiceStub(channel),
        )


class InstanceHandle:
    """A started instance: its first snapshot, and `await handle.result()` for how it ended."""

    def __init__(self, client: AsyncEngineClient, started: Instance, already_started: bool = False) -> None:
        self._client = client
        self.started = started
        # The start's request_id matched an earlier start: this is that start's instance.
        self.already_started = already_started

    @property
    def id(self) -> str:
        return self.started.id

    async def refresh(self) -> Instance:
        return await self._client.get(self.id)

    async def result(self, timeout: float | None = None, *, stop_on_incident: bool = True) -> Instance:
        """Waits until the instance completes and returns it.

        Raises InstanceFailed when it was canceled or (with `stop_on_incident`) an incident holds it,
        and TimeoutError when `timeout` seconds pass first.
        """
        return await self._client.wait(self.id, timeout, stop_on_incident=stop_on_incident)


class AsyncEngineClient:
    """The engine's operator API; use as `async with AsyncEngineClient(...) as client:`.

    Address, token (`token` or `token_file`), TLS (`tls_ca`, `tls_cert`, `tls_key`) and `timeout` from
    the arguments or ABADA_ENGINE_ADDRESS, ABADA_TOKEN / ABADA_TOKEN_FILE, ABADA_TLS_*; or a whole
    `connection`."""

    def __init__(
        self,
        address: str | None = None,
        *,
        connection: Connection | None = None,
        **options: Unpack[ConnectionOptions],
    ) -> None:
        self.connection = connection or Connection.resolve(address, **options)
        self.timeout = self.connection.timeout
        self._channel: grpc.aio.Channel | None = None
        self._stubs: Stubs | None = None

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stubs = None

    @property
    def stubs(self) -> Stubs:
        """The generated stubs; the channel is opened on first use, as aio channels belong to the
        loop that made them."""
        if self._stubs is None:
            self._channel = self.connection.open_aio_channel()
            self._stubs = Stubs.over(self._channel)
        return self._stubs

    @property
    def tasks(self) -> external_task_pb2_grpc.ExternalTaskServiceAsyncStub:
        return self.stubs.tasks

    async def call(
        self,
        method: Callable[[], grpc.aio.UnaryUnaryMultiCallable[Any, Reply]],
        request: Any,
        timeout: float | None = None,
    ) -> Reply:
        """One RPC with the token and a deadline; a refusal becomes an AbadaError."""
        try:
            return await method()(request, timeout=timeout or self.timeout, metadata=self.connection.metadata)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    async def pages(
        self,
        method: Callable[[], grpc.aio.UnaryUnaryMultiCallable[Any, Any]],
        request: Any,
        field: str,
        page_size: int = _PAGE_SIZE,
    ) -> AsyncIterator[Any]:
        """Every row of a list, page after page: `request` (a List...Request) is sent again with each
        next_page_token until the engine says there is no more. The engine pages by each row's sort key,
        so rows that arrive while this walks are never yielded twice."""
        request.page_size = page_size
        request.page_token = ""
        while True:
            reply = await self.call(method, request)
            for row in getattr(reply, field):
                yield row
            if not reply.next_page_token:
                return
            request.page_token = reply.next_page_token

    # Definitions

    async def deploy(self, bundle: str | os.PathLike[str], *, source_name: str | None = None) -> Deployment:
        """Deploys a YAML bundle, given as a path or as its text (then name it with `source_name`)."""
        content, name = await asyncio.to_thread(_bundle_text, bundle)
        reply = await self.call(
            lambda: self.stubs.definitions.Deploy, requests.deploy(content, source_name or name)
        )
        return Deployment(
            [Definition.from_proto(d) for d in reply.definitions], list(reply.created_process_ids)
        )

    async def definitions(self, process_id: str = "") -> list[Definition]:
        request = requests.list_definitions(process_id)
        return [
            Definition.from_proto(d)
            async for d in self.pages(lambda: self.stubs.definitions.ListDefinitions, request, "definitions")
        ]

    # Instances

    @overload
    async def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: Literal[False] = False,
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> InstanceHandle: ...

    @overload
    async def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: Literal[True],
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> Instance: ...

    async def start(
        self,
        process_id: str,
        variables: dict[str, Any] | None = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
        **options: Unpack[requests.StartOptions],
    ) -> InstanceHandle | Instance:
        """Starts an instance (latest version unless `version`). With `wait=True`, returns it completed.

        A `request_id` makes the start idempotent for a day: sent again, it starts nothing and answers
        the first start's instance (a re-sent webhook starts one instance)."""
        reply = await self.call(
            lambda: self.stubs.processes.StartInstance,
            requests.start_instance(process_id, variables, **options),
        )
        handle = InstanceHandle(self, Instance.from_proto(reply.instance), reply.already_started)
        return await handle.result(timeout) if wait else handle

    async def get(self, instance_id: str) -> Instance:
        reply = await self.call(
            lambda: self.stubs.processes.GetInstance, process_pb2.GetInstanceRequest(instance_id=instance_id)
        )
        return Instance.from_proto(reply.instance)

    async def history(self, instance_id: str) -> list[HistoryEvent]:
        reply = await self.call(
            lambda: self.stubs.processes.GetHistory, process_pb2.GetHistoryRequest(instance_id=instance_id)
        )
        return [HistoryEvent.from_proto(e) for e in reply.events]

    async def list_instances(
        self,
        process_id: str = "",
        state: InstanceState | None = None,
        limit: int = 100,
        **filters: Unpack[requests.InstanceFilter],
    ) -> list[Instance]:
        """The newest `limit` instances that match (`parent_instance_id`: the ones that instance's call
        activities started); `iter_instances` walks them all."""
        found: list[Instance] = []
        async for instance in self.iter_instances(
            process_id, state, page_size=min(limit, _PAGE_SIZE), **filters
        ):
            found.append(instance)
            if len(found) == limit:
                break
        return found

    async def iter_instances(
        self,
        process_id: str = "",
        state: InstanceState | None = None,
        *,
        page_size: int = _PAGE_SIZE,
        **filters: Unpack[requests.InstanceFilter],
    ) -> AsyncIterator[Instance]:
        """Every instance that matches `filters` (see `requests.InstanceFilter`), newest first, read page
        by page as the caller goes."""
        request = requests.list_instances(process_id, state, **filters)
        async for instance in self.pages(
            lambda: self.stubs.processes.ListInstances, request, "instances", page_size
        ):
            yield Instance.from_proto(instance)

    async def publish(
        self,
        name: str,
        correlation_key: str,
        variables: dict[str, Any] | None = None,
        *,
        ttl: timedelta = timedelta(0),
        message_id: str = "",
    ) -> Publication:
        """Publish a message: it goes to the oldest instance waiting for `name` with this
        `correlation_key`, or waits `ttl` in the buffer for one to arrive; a `message_id` sent again
        within the ttl (a re-sent webhook) answers the first publication and delivers nothing."""
        reply = await self.call(
            lambda: self.stubs.processes.PublishMessage,
            requests.publish_message(name, correlation_key, variables, ttl=ttl, message_id=message_id),
        )
        return Publication.from_proto(reply)

    async def cancel(self, instance_id: str, reason: str = "") -> Instance:
        reply = await self.call(
            lambda: self.stubs.processes.CancelInstance,
            process_pb2.CancelInstanceRequest(instance_id=instance_id, reason=reason),
        )
        return Instance.from_proto(reply.instance)

    async def purge(
        self, before: datetime, process_id: str = "", *, dry_run: bool = False
    ) -> process_pb2.PurgeInstancesResponse:
        """Delete, now, finished instances (of `process_id`, if given) that ended before `before` (aware);
        with `dry_run`, count them. Answers `.instances` and `.rows`."""
        return await self.call(
            lambda: self.stubs.processes.PurgeInstances,
            requests.purge_instances(before, process_id, dry_run=dry_run),
        )

    async def erase(
        self, business_key: str = "", where: dict[str, Any] | None = None, *, cancel_active: bool = False
    ) -> process_pb2.EraseInstancesResponse:
        """Erase one customer's instances (business key and/or variable values), whatever their age; one
        audit row stays (`.erasure_id`). Active ones refuse it (`INSTANCES_ACTIVE`) unless `cancel_active`."""
        return await self.call(
            lambda: self.stubs.processes.EraseInstances,
            requests.erase_instances(business_key, where, cancel_active=cancel_active),
        )

    async def modify(
        self,
        instance_id: str,
        reason: str,
        set_variables: dict[str, Any] | None = None,
        unset_variables: Sequence[str] = (),
        moves: Sequence[tuple[str, str]] = (),
    ) -> Instance:
        """Repair an active instance (operator): variables set or removed, tokens moved from one node to
        another (the task left is withdrawn); each change is a history entry naming the caller."""
        reply = await self.call(
            lambda: self.stubs.processes.ModifyInstance,
            requests.modify_instance(instance_id, reason, set_variables, unset_variables, moves),
        )
        return Instance.from_proto(reply.instance)

    async def migrate(
        self,
        process_id: str,
        from_version: int,
        to_version: int,
        mappings: dict[str, str] | None = None,
        instance_ids: Sequence[str] = (),
        *,
        dry_run: bool = False,
    ) -> process_pb2.MigrateInstancesResponse:
        """Move active instances to another version under a plan checked first (`.plan`, `.instances`);
        refused whole (`MIGRATION_PLAN_INVALID`) when a node cannot be mapped."""
        return await self.call(
            lambda: self.stubs.processes.MigrateInstances,
            requests.migrate_instances(
                process_id, from_version, to_version, mappings, instance_ids, dry_run=dry_run
            ),
        )

    async def create_batch(
        self,
        kind: Literal["retry-incidents", "cancel", "migrate", "modify"],
        process_id: str,
        **options: Unpack[requests.BatchOptions],
    ) -> batch_pb2.Batch:
        """A batch applying `kind` to every instance of `process_id` matching the filter `options` give
        (see `requests.create_batch`); the engine works through it in the background."""
        request = requests.create_batch(kind, process_id, **options)
        created = await self.call(lambda: self.stubs.batches.CreateBatch, request)
        return created.batch

    async def batches(self, limit: int = 100) -> list[batch_pb2.Batch]:
        """The newest batches first."""
        listed = await self.call(
            lambda: self.stubs.batches.ListBatches, batch_pb2.ListBatchesRequest(page_size=limit)
        )
        return list(listed.batches)

    async def batch(
        self, batch_id: str, *, outcome: str = "", after_instance_id: str = "", page_size: int = 1000
    ) -> batch_pb2.GetBatchResponse:
        """A batch's progress (`.batch`) and a page of its instances' outcomes (`.items`)."""
        return await self.call(
            lambda: self.stubs.batches.GetBatch,
            requests.get_batch(
                batch_id, outcome=outcome, after_instance_id=after_instance_id, page_size=page_size
            ),
        )

    async def pause_batch(self, batch_id: str) -> batch_pb2.Batch:
        paused = await self.call(
            lambda: self.stubs.batches.PauseBatch, batch_pb2.PauseBatchRequest(batch_id=batch_id)
        )
        return paused.batch

    async def resume_batch(self, batch_id: str) -> batch_pb2.Batch:
        resumed = await self.call(
            lambda: self.stubs.batches.ResumeBatch, batch_pb2.ResumeBatchRequest(batch_id=batch_id)
        )
        return resumed.batch

    async def cancel_batch(self, batch_id: str) -> batch_pb2.Batch:
        """Ends the batch; its instances not yet worked on stay as they are."""
        canceled = await self.call(
            lambda: self.stubs.batches.CancelBatch, batch_pb2.CancelBatchRequest(batch_id=batch_id)
        )
        return canceled.batch

    async def wait(
        self, instance_id: str, timeout: float | None = None, *, stop_on_incident: bool = True
    ) -> Instance:
        """Polls until the instance completes; see InstanceHandle.result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = _FIRST_POLL_SECONDS
        while True:
            instance = await self.get(instance_id)
            if instance.state is InstanceState.COMPLETED:
                return instance
            if instance.state is InstanceState.CANCELED:
                raise InstanceFailed(f"instance {instance_id} was canceled", instance, [])
            if stop_on_incident and instance.open_incidents:
                found = await self.incidents(instance_id=instance_id)
                summary = "; ".join(f"{i.type}: {i.message}" for i in found) or "an open incident"
                raise InstanceFailed(
                    f"instance {instance_id} is held at {instance.current_node_id} by {summary}",
                    instance,
                    found,
                )
            if deadline is not None and time.monotonic() + delay > deadline:
                raise TimeoutError(
                    f"instance {instance_id} is still {instance.state} at {instance.current_node_id} "
                    f"after {timeout:g}s"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, _MAX_POLL_SECONDS)

    # Incidents and user tasks

    async def incidents(
        self, *, instance_id: str = "", include_resolved: bool = False, type: str = ""
    ) -> list[Incident]:
        found: list[Incident] = []
        for state in requests.incident_states(include_resolved):
            request = requests.list_incidents(state, instance_id=instance_id, type=type)
            found += [
                Incident.from_proto(i)
                async for i in self.pages(
                    lambda: self.stubs.incidents.ListIncidents, request, "incidents", _LONG_PAGE_SIZE
                )
            ]
        return sorted(found, key=lambda i: (i.created_at is None, i.created_at))

    async def resolve_incident(
        self,
        incident_id: str,
        resolution: Resolution,
        *,
        result: dict[str, Any] | None = None,
        comment: str = "",
    ) -> Incident:
        request = requests.resolve_incident(incident_id, resolution, result=result, comment=comment)
        reply = await self.call(lambda: self.stubs.incidents.ResolveIncident, request)
        return Incident.from_proto(reply.incident)

    async def resolve_incidents(
        self,
        type: str,
        resolution: Resolution,
        *,
        dependency: dependency_pb2.Dependency | None = None,
        process_id: str = "",
        comment: str = "",
    ) -> incident_pb2.ResolveIncidentsResponse:
        """Resolves every open incident of `type` (RETRY or CANCEL_INSTANCE), a thousand a call, until
        none is left or a call resolves none; the answer gathers every call's resolved and refused ones."""
        request = requests.resolve_incidents(
            type, resolution, dependency=dependency, process_id=process_id, comment=comment
        )
        total = incident_pb2.ResolveIncidentsResponse()
        while True:
            reply = await self.call(lambda: self.stubs.incidents.ResolveIncidents, request)
            total.resolved.extend(reply.resolved)
            total.refused.extend(reply.refused)
            # Refused ones stay open and are not asked again: a call that resolves none is the last.
            if not reply.remaining or not reply.resolved:
                total.remaining = reply.remaining
                return total

    async def user_tasks(self, instance_id: str = "") -> list[UserTask]:
        request = requests.list_user_tasks(instance_id)
        return [
            UserTask.from_proto(t)
            async for t in self.pages(
                lambda: self.stubs.processes.ListUserTasks, request, "user_tasks", _LONG_PAGE_SIZE
            )
        ]

    async def complete_user_task(
        self, user_task_id: str, variables: dict[str, Any] | None = None
    ) -> Instance:
        reply = await self.call(
            lambda: self.stubs.processes.CompleteUserTask,
            requests.complete_user_task(user_task_id, variables),
        )
        return Instance.from_proto(reply.instance)

    # Approvals of tool calls (the approver or operator role)

    async def list_approvals(
        self,
        *,
        process_id: str = "",
        business_key: str = "",
        tool_ref: str = "",
        state: ApprovalState = ApprovalState.PENDING,
    ) -> list[Approval]:
        """Tool calls waiting for a decision (or, with `state`, decided ones), oldest first."""
        request = requests.list_approvals(
            process_id=process_id, business_key=business_key, tool_ref=tool_ref, state=state
        )
        return [
            Approval.from_proto(a)
            async for a in self.pages(
                lambda: self.stubs.approvals.ListApprovals, request, "approvals", _LONG_PAGE_SIZE
            )
        ]

    async def get_approval(self, approval_id: str) -> Approval:
        reply = await self.call(
            lambda: self.stubs.approvals.GetApproval, approval_pb2.GetApprovalRequest(approval_id=approval_id)
        )
        return Approval.from_proto(reply.approval)

    async def approve(
        self, approval_id: str, *, arguments: dict[str, Any] | None = None, comment: str = ""
    ) -> Approval:
        """Approves a call: it runs when the task is offered again, with `arguments` if given (edited)."""
        request = requests.approve(approval_id, arguments=arguments, comment=comment)
        reply = await self.call(lambda: self.stubs.approvals.DecideApproval, request)
        return Approval.from_proto(reply.approval)

    async def reject(self, approval_id: str, reason: str) -> Approval:
        """Rejects a call: it never runs; the model reads "rejected by a person: <reason>" and goes on."""
        reply = await self.call(
            lambda: self.stubs.approvals.DecideApproval, requests.reject(approval_id, reason)
        )
        return Approval.from_proto(reply.approval)

    async def journal(self, task_id: str) -> list[JournalStep]:
        reply = await self.call(
            lambda: self.stubs.tasks.GetJournal, external_task_pb2.GetJournalRequest(task_id=task_id)
        )
        return sorted((JournalStep.from_proto(s) for s in reply.steps), key=lambda s: s.sequence)

    # What operators watch: the queue and the dependencies agent tasks need

    async def topics(self) -> queue_pb2.ListTopicsResponse:
        """Queue figures per topic (ready, leased, delayed, demand, oldest wait) and per model profile."""
        return await self.call(lambda: self.stubs.queue.ListTopics, queue_pb2.ListTopicsRequest())

    async def dependencies(self) -> list[dependency_pb2.DependencyStatus]:
        """Each dependency workers reported (models, tool servers, the broker, its secret store)."""
        reply = await self.call(
            lambda: self.stubs.dependencies.ListDependencies, dependency_pb2.ListDependenciesRequest()
        )
        return list(reply.dependencies)


def _bundle_text(bundle: str | os.PathLike[str]) -> tuple[str, str]:
    """(content, file name) of a bundle given as a path, or as YAML text (named bundle.yaml)."""
    if isinstance(bundle, os.PathLike) or ("\n" not in bundle and Path(bundle).is_file()):
        path = Path(bundle)
        return path.read_text(encoding="utf-8"), path.name
    return bundle, "bundle.yaml"


__all__ = ["AbadaError", "AsyncEngineClient", "InstanceHandle"]
