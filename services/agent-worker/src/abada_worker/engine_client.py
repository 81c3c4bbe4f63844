"""The engine's ExternalTaskService as the worker uses it: bearer metadata, retries, domain errors.

Every call under a lease may be retried on a transient failure, because the engine answers a
repeated request the same way (an identical AppendStep gets the identical answer). Refusals become
the worker's own exceptions: LeaseLost, LimitExceeded, or EngineRefused.

The steps the worker's tasks journal at the same moment go to the engine together: the first alone,
at once, and those that arrive while it is on its way in one AppendSteps (`abada_common.group_commit`).
Each is answered on its own, exactly as its own AppendStep would be.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from abada.engine.v1 import external_task_pb2, external_task_pb2_grpc
from abada_common.group_commit import GroupCommit
from abada_common.struct_codec import to_struct
from abada_sdk.connection import BearerToken

from .dependencies import Dependency, DependencyDown, Verdict
from .errors import AttemptFailed, EngineUnavailable, LeaseLost, LimitExceeded, QuotaWait
from .logs import redactor
from .rpc_errors import (
    DEPENDENCY_UNAVAILABLE,
    LIMIT_EXCEEDED,
    MODEL_QUOTA_EXHAUSTED,
    RpcFailure,
    failure_of,
    failure_of_refusal,
)

log = logging.getLogger(__name__)

Reply = TypeVar("Reply")
_FIRST_RETRY_SECONDS = 0.1
_MAX_RETRY_SECONDS = 2.0
_CONFIGURATION_REASONS = frozenset({"BINDING_NOT_FOUND", "VARIABLE_NOT_ALLOWED"})
# The engine takes at most this many steps in one AppendSteps.
MAX_STEPS_PER_CALL = 100


class EngineRefused(AttemptFailed):
    def __init__(self, failure: RpcFailure) -> None:
        code = failure.reason or failure.code.name
        super().__init__(code, failure.message, no_retry=code in _CONFIGURATION_REASONS)
        self.failure = failure


@dataclass(frozen=True)
class LeaseRef:
    task_id: str
    lease_token: str
    attempt: int


@dataclass
class EagerDispatch:
    """Eager dispatch: every Complete asks for the worker's next task (CompleteRequest.fetch_next), so
    the slot a finished task frees is refilled in the same round trip instead of by the next poll.

    One task per Complete: the slot being freed is one the poller did not count when it last asked
    for work, so the worker never holds more tasks than its concurrency. Off once the worker stops.
    """

    topic: str
    lease_ms: int
    deliver: Callable[[external_task_pb2.ExternalTask], None]
    enabled: bool = True


class EngineClient:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        worker_id: str,
        caller_token: BearerToken,
        *,
        retry_seconds: float = 10.0,
        call_timeout_seconds: float = 10.0,
    ) -> None:
        self._stub = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
        self.worker_id = worker_id
        self._token = caller_token
        self._retry_seconds = retry_seconds
        self._timeout = call_timeout_seconds
        # Set by a worker that takes its next task in the answer to a Complete (see EagerDispatch).
        self.eager: EagerDispatch | None = None
        self._steps = GroupCommit(
            self._append_steps, max_batch=MAX_STEPS_PER_CALL, each_alone_on_failure=True
        )
        # Off for good once the engine answers AppendSteps UNIMPLEMENTED (an engine older than it).
        self._batch_steps = True
        # Tasks with a step in the line or on its way in it.
        self._tasks_in_line: set[str] = set()

    async def fetch_and_lock(
        self, topic: str, lease_ms: int, max_tasks: int, wait_ms: int
    ) -> list[external_task_pb2.ExternalTask]:
        """One long poll, no retries: the poller owns the backoff when the engine is down."""
        request = external_task_pb2.FetchAndLockRequest(
            worker_id=self.worker_id,
            topics=[external_task_pb2.TopicSubscription(name=topic, lease_ms=lease_ms)],
            max_tasks=max_tasks,
            wait_ms=wait_ms,
        )
        timeout = self._timeout + wait_ms / 1000
        reply = await self._call(self._stub.FetchAndLock, request, timeout, retry_seconds=0.0)
        return list(reply.tasks)

    async def extend_lease(self, lease: LeaseRef, lease_ms: int) -> None:
        request = external_task_pb2.ExtendLeaseRequest(
            task_id=lease.task_id, worker_id=self.worker_id, lease_token=lease.lease_token, lease_ms=lease_ms
        )
        # One try, no longer than a renewal period: the keeper retries on its own schedule.
        timeout = min(self._timeout, max(0.5, lease_ms / 3000))
        await self._call(self._stub.ExtendLease, request, timeout, retry_seconds=0.0)

    async def release_lease(self, lease: LeaseRef, reason: str) -> None:
        """Hands back a task this attempt has not begun: offered again at once, no failure counted."""
        request = external_task_pb2.ReleaseLeaseRequest(
            task_id=lease.task_id, worker_id=self.worker_id, lease_token=lease.lease_token, reason=reason
        )
        await self._call(
            self._stub.ReleaseLease, request, self._timeout, retry_seconds=min(self._retry_seconds, 2.0)
        )

    async def append_step(
        self, request: external_task_pb2.AppendStepRequest
    ) -> external_task_pb2.AppendStepResponse:
        request.worker_id = self.worker_id
        if request.task_id in self._tasks_in_line or not self._batch_steps:
            # The engine takes one step a task per AppendSteps; a task's steps that meet (the calls
            # of one turn finishing together) go on their own, as each would have without batching.
            return await self._call(self._stub.AppendStep, request, self._timeout)
        self._tasks_in_line.add(request.task_id)
        try:
            answer = await self._steps.submit(request)
        finally:
            self._tasks_in_line.discard(request.task_id)
        if isinstance(answer, external_task_pb2.AppendStepResponse):
            return answer
        if answer.transient:
            # The engine could not journal it just then: again alone, with the usual retries.
            return await self._call(self._stub.AppendStep, request, self._timeout)
        raise _refusal(answer)

    async def _append_steps(
        self, requests: Sequence[external_task_pb2.AppendStepRequest]
    ) -> list[external_task_pb2.AppendStepResponse | RpcFailure]:
        """One batch of the step line: a single step as AppendStep (with retries), several in one
        AppendSteps. A batch that fails whole is sent again a step at a time by the line."""
        if len(requests) == 1:
            return [await self._call(self._stub.AppendStep, requests[0], self._timeout)]
        try:
            reply = await self._stub.AppendSteps(
                external_task_pb2.AppendStepsRequest(worker_id=self.worker_id, steps=requests),
                timeout=self._timeout,
                metadata=self._token.metadata(),
            )
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._batch_steps = False
            raise
        return [
            result.appended if result.HasField("appended") else failure_of_refusal(result.refused)
            for result in reply.results
        ]

    async def complete(
        self,
        lease: LeaseRef,
        variables: dict[str, Any],
        metadata: external_task_pb2.AttemptMetadata,
        invalid_output_reason: str = "",
    ) -> external_task_pb2.CompleteResponse:
        request = external_task_pb2.CompleteRequest(
            task_id=lease.task_id,
            worker_id=self.worker_id,
            lease_token=lease.lease_token,
            variables=to_struct(variables),
            metadata=metadata,
            invalid_output_reason=invalid_output_reason,
        )
        eager = self.eager if self.eager is not None and self.eager.enabled else None
        if eager is not None:
            request.fetch_next.CopyFrom(
                external_task_pb2.FetchNext(
                    topics=[external_task_pb2.TopicSubscription(name=eager.topic, lease_ms=eager.lease_ms)],
                    max_tasks=1,
                )
            )
        reply = await self._call(self._stub.Complete, request, self._timeout)
        if eager is not None:
            for task in reply.next_tasks:
                eager.deliver(task)
        return reply

    async def await_approval(self, lease: LeaseRef) -> external_task_pb2.AwaitApprovalResponse:
        """Hands the task back to wait for a person's approval of the calls journaled AWAITING_APPROVAL."""
        request = external_task_pb2.AwaitApprovalRequest(
            task_id=lease.task_id, worker_id=self.worker_id, lease_token=lease.lease_token
        )
        return await self._call(self._stub.AwaitApproval, request, self._timeout)

    async def fail(self, lease: LeaseRef, failure: AttemptFailed) -> external_task_pb2.FailResponse:
        request = external_task_pb2.FailRequest(
            task_id=lease.task_id,
            worker_id=self.worker_id,
            lease_token=lease.lease_token,
            error_code=failure.error_code,
            error_message=failure.message[:10_000],
            error_details=to_struct(failure.details),
            no_retry=failure.no_retry,
        )
        return await self._call(self._stub.Fail, request, self._timeout)

    async def report_dependency(
        self,
        lease: LeaseRef,
        dependency: Dependency,
        *,
        up: bool,
        failure: DependencyDown | None,
        wait_in_place: bool,
    ) -> Verdict:
        """Tells the engine what a call to `dependency` met; its answer says what the attempt does next."""
        request = external_task_pb2.ReportDependencyRequest(
            task_id=lease.task_id,
            worker_id=self.worker_id,
            lease_token=lease.lease_token,
            dependency=dependency.to_proto(),
            up=up,
            wait_in_place=wait_in_place,
        )
        if failure is not None:
            request.error_message = redactor.redact(failure.message)[:2_000]
            request.retry_after_ms = int(failure.retry_after_seconds * 1000)
            request.not_called = failure.not_called
        reply = await self._call(self._stub.ReportDependency, request, self._timeout)
        return Verdict(
            action=external_task_pb2.DependencyAction.Name(reply.action).removeprefix("DEPENDENCY_ACTION_"),
            retry_at=reply.retry_time.ToDatetime(datetime.UTC) if reply.HasField("retry_time") else None,
            probe=reply.probe,
            incident_id=reply.incident_id,
        )

    async def _call(
        self,
        method: Callable[..., Awaitable[Reply]],
        request: Any,
        timeout: float,
        *,
        retry_seconds: float | None = None,
    ) -> Reply:
        budget = self._retry_seconds if retry_seconds is None else retry_seconds
        give_up_at = time.monotonic() + budget
        delay = _FIRST_RETRY_SECONDS
        while True:
            try:
                return await method(request, timeout=timeout, metadata=self._token.metadata())
            except grpc.aio.AioRpcError as error:
                failure = failure_of(error)
            if not failure.transient:
                raise _refusal(failure)
            if time.monotonic() + delay > give_up_at:
                raise EngineUnavailable(f"{failure.code.name}: {failure.message}")
            log.debug("engine call failed (%s), retrying in %.2fs", failure.code.name, delay)
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, _MAX_RETRY_SECONDS)


def _refusal(failure: RpcFailure) -> Exception:
    if failure.lease_lost:
        return LeaseLost(failure.reason or failure.code.name, failure.message)
    if failure.reason == LIMIT_EXCEEDED:
        return LimitExceeded(failure.metadata.get("limit", ""), failure.message)
    if failure.reason == MODEL_QUOTA_EXHAUSTED:
        wait = failure.retry_after_seconds if failure.retry_after_seconds is not None else 1.0
        return QuotaWait(wait, failure.message, "engine")
    held = Dependency.from_key(failure.metadata.get("dependency", ""))
    if failure.reason == DEPENDENCY_UNAVAILABLE and held is not None:
        return DependencyDown(
            held, failure.message, retry_after_seconds=failure.retry_after_seconds or 0.0, not_called=True
        )
    return EngineRefused(failure)
