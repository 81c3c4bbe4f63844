"""ExternalTaskService: thin translation onto leases, completions and the journal."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from abada.engine.v1 import external_task_pb2, external_task_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.telemetry import inject_traceparent
from google.protobuf import struct_pb2
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace

from abada_engine.auth import Caller, require_worker
from abada_engine.errors import invalid
from abada_engine.runtime.approvals import Approvals
from abada_engine.runtime.completion import AttemptMetadata, Completions
from abada_engine.runtime.dependencies import Dependencies, Report
from abada_engine.runtime.flow.contract import Verdict
from abada_engine.runtime.instances import MAX_VARIABLES_BYTES
from abada_engine.runtime.journal import Journal, StepRequest
from abada_engine.runtime.leases import Leases, Subscription, check_fetch
from abada_engine.runtime.offload import LARGE_VALUE_BYTES, large_value_turn, run_cpu_work
from abada_engine.store.states import WORKER_STEP_STATES

from . import messages
from .convert import chosen, from_struct, parse_uuid, storable, timestamp
from .errors import as_refusal, status_of
from .guard import ServiceHandler, current_caller


class _SentByWorker(Protocol):
    """An item of a batch, whose worker_id the batch fills in when it is left empty."""

    worker_id: str


_Item = TypeVar("_Item", bound=_SentByWorker)
_Answer = TypeVar("_Answer")
_Result = TypeVar("_Result", external_task_pb2.StepResult, external_task_pb2.CompletionResult)
_KIND_NAMES = {value: name for name, value in messages.STEP_KINDS.items()}
_STATE_NAMES = {value: name for name, value in messages.STEP_STATES.items() if name in WORKER_STEP_STATES}
_DEPENDENCY_ACTIONS = {
    "CONTINUE": external_task_pb2.DEPENDENCY_ACTION_CONTINUE,
    "WAIT": external_task_pb2.DEPENDENCY_ACTION_WAIT,
    "PARKED": external_task_pb2.DEPENDENCY_ACTION_PARKED,
    "INCIDENT_RAISED": external_task_pb2.DEPENDENCY_ACTION_INCIDENT_RAISED,
}
_OUTCOMES = {
    (Verdict.ACCEPTED, False): external_task_pb2.COMPLETE_OUTCOME_ADVANCED,
    (Verdict.INVALID_OUTPUT, True): external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED,
    (Verdict.LOW_CONFIDENCE, True): external_task_pb2.COMPLETE_OUTCOME_LOW_CONFIDENCE_ROUTED,
}


def _metadata(message: external_task_pb2.AttemptMetadata) -> AttemptMetadata:
    return AttemptMetadata(
        model=message.model,
        provider=message.provider,
        input_tokens=message.input_tokens,
        output_tokens=message.output_tokens,
        tools_used=tuple(message.tools_used),
        duration_ms=message.duration_ms,
        prompt_hash=message.prompt_hash,
        confidence=message.confidence if message.HasField("confidence") else None,
        model_calls=message.model_calls,
        tool_calls=message.tool_calls,
        cached_input_tokens=message.cached_input_tokens,
        reasoning_tokens=message.reasoning_tokens,
        quota_wait_ms=message.quota_wait_ms,
    )


# A batch (of completions, of steps) is one call's work: bounded like a fetch.
MAX_BATCH = 100


def _next_subscriptions(
    caller: Caller | None, worker_id: str, fetch_next: external_task_pb2.FetchNext | None, prefix: str
) -> list[Subscription]:
    """The topics of an eager dispatch (none without one), refused if the fetch would be."""
    if fetch_next is None or not fetch_next.max_tasks:
        return []
    subscriptions = [Subscription(t.name, t.lease_ms) for t in fetch_next.topics]
    require_worker(caller, worker_id, [s.topic for s in subscriptions])
    check_fetch(worker_id, subscriptions, fetch_next.max_tasks, 0, field_prefix=prefix)
    return subscriptions


class _BatchItem(Protocol):
    """A completion or a step: what a batch is checked on."""

    @property
    def worker_id(self) -> str: ...
    @property
    def task_id(self) -> str: ...


def _check_batch(worker_id: str, items: Sequence[_BatchItem], field: str) -> None:
    """A batch the engine would not take apart cleanly is refused whole, before anything changes: it
    holds 1 to MAX_BATCH items, all of this worker's, at most one a task."""
    count = len(items)
    if not 1 <= count <= MAX_BATCH:
        raise invalid(ErrorReason.INVALID_ARGUMENT, field, f"send 1 to {MAX_BATCH} {field}, not {count}")
    seen: set[str] = set()
    for index, item in enumerate(items):
        where = f"{field}[{index}]"
        if item.worker_id not in ("", worker_id):
            raise invalid(
                ErrorReason.WORKER_ID_MISMATCH,
                f"{where}.worker_id",
                f"must be empty or this request's worker_id {worker_id!r}",
            )
        if item.task_id in seen:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                f"{where}.task_id",
                f"task {item.task_id!r} is in this call twice",
            )
        seen.add(item.task_id)


def _batch_result(result: _Result, outcome: Message, answered: str) -> _Result:
    """An item's entry in a batch's answer: its refusal, or the single call's answer in `answered`."""
    if isinstance(outcome, external_task_pb2.Refusal):
        result.refused.CopyFrom(outcome)
    else:
        getattr(result, answered).CopyFrom(outcome)
    return result


_tracer = trace.get_tracer("abada.engine")


def _traced(task: external_task_pb2.ExternalTask, new_trace: bool = False) -> external_task_pb2.ExternalTask:
    """Opens the attempt's span, so the worker's spans for this attempt join the same trace.

    Under FetchAndLock it is a child of that call. A task handed out with a Complete (eager dispatch)
    starts its own trace instead, linked to the call that handed it out: one trace per attempt.
    """
    links = [trace.Link(trace.get_current_span().get_span_context())] if new_trace else None
    with _tracer.start_as_current_span(
        f"lease {task.topic_name}",
        context=otel_context.Context() if new_trace else None,
        links=links,
        attributes={
            "abada.task.id": task.id,
            "abada.task.attempt": task.attempt,
            "abada.instance.id": task.instance_id,
            "abada.node.id": task.node_id,
        },
    ):
        task.traceparent = inject_traceparent()
    return task


class ExternalTaskHandler(ServiceHandler, external_task_pb2_grpc.ExternalTaskServiceServicer):
    _leases: Leases
    _completions: Completions
    _journal: Journal
    _approvals: Approvals
    _dependencies: Dependencies

    async def AppendStep(
        self, request: external_task_pb2.AppendStepRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.AppendStepResponse:
        require_worker(current_caller.get(), request.worker_id)
        return await self._append(request)

    async def AppendSteps(
        self, request: external_task_pb2.AppendStepsRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.AppendStepsResponse:
        require_worker(current_caller.get(), request.worker_id)
        _check_batch(request.worker_id, request.steps, "steps")
        # Each step on its own, all at once: admissions that reach the database together share the
        # model's group commit, and one refused leaves the others as they would be without it.
        outcomes = await self._each_or_refused(
            request.steps, request.worker_id, self._append, "ExternalTaskHandler.AppendSteps"
        )
        return external_task_pb2.AppendStepsResponse(
            results=[_batch_result(external_task_pb2.StepResult(), o, "appended") for o in outcomes]
        )

    async def _each_or_refused(
        self,
        items: Sequence[_Item],
        worker_id: str,
        run: Callable[[_Item], Awaitable[_Answer]],
        where: str,
    ) -> list[_Answer | external_task_pb2.Refusal]:
        """Every item of a batch on its own, all at once (see `_batch_item`), answers in the batch's order."""
        return await asyncio.gather(*(self._batch_item(item, worker_id, run, where) for item in items))

    async def _batch_item(
        self,
        item: _Item,
        worker_id: str,
        run: Callable[[_Item], Awaitable[_Answer]],
        where: str,
    ) -> _Answer | external_task_pb2.Refusal:
        """One item of a batch, sent under the batch's worker_id unless it names its own: what the
        single call answers, or what it would have failed with (the other items go on)."""
        if not item.worker_id:
            item.worker_id = worker_id
        try:
            return await run(item)
        except Exception as error:
            return self._refusal(error, where)

    async def _append(
        self, request: external_task_pb2.AppendStepRequest
    ) -> external_task_pb2.AppendStepResponse:
        kind = chosen(
            _KIND_NAMES, request.kind, "kind", "must be STEP_KIND_MODEL_CALL or STEP_KIND_TOOL_CALL"
        )
        state = chosen(
            _STATE_NAMES, request.state, "state", "must be STARTED, COMPLETED, FAILED or AWAITING_APPROVAL"
        )
        sent_request = from_struct(request.request, "request") if request.HasField("request") else None
        sent_response = from_struct(request.response, "response") if request.HasField("response") else None
        result = await self._journal.append(
            StepRequest(
                task_id=parse_uuid(request.task_id, "task_id"),
                worker_id=request.worker_id,
                lease_token=request.lease_token,
                attempt=request.attempt,
                sequence=request.sequence,
                kind=kind,
                state=state,
                tool_ref=request.tool_ref,
                request=sent_request,
                response=sent_response,
                input_tokens=request.tokens.input_tokens,
                output_tokens=request.tokens.output_tokens,
            )
        )
        sent = [(sent_request, request.request), (sent_response, request.response)]
        return external_task_pb2.AppendStepResponse(
            step=messages.step(result.step, [(plain, struct) for plain, struct in sent if plain is not None]),
            idempotency_key=result.idempotency_key,
        )

    def _refusal(self, error: Exception, where: str) -> external_task_pb2.Refusal:
        """One item of a batch refused: what the single call would have failed with."""
        refusal = as_refusal(error, where, self.database)
        status = status_of(refusal)
        return external_task_pb2.Refusal(
            code=status.code,
            message=status.message,
            reason=refusal.reason_name,
            status=status.SerializeToString(),
        )

    async def GetJournal(
        self, request: external_task_pb2.GetJournalRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.GetJournalResponse:
        steps = await self._journal.journal(parse_uuid(request.task_id, "task_id"))
        return external_task_pb2.GetJournalResponse(steps=[messages.step(s) for s in steps])

    async def FetchAndLock(
        self, request: external_task_pb2.FetchAndLockRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.FetchAndLockResponse:
        subscriptions = [Subscription(t.name, t.lease_ms) for t in request.topics]
        require_worker(current_caller.get(), request.worker_id, [s.topic for s in subscriptions])
        locked = await self._leases.fetch_and_lock(
            request.worker_id, subscriptions, request.max_tasks, request.wait_ms
        )
        return external_task_pb2.FetchAndLockResponse(
            tasks=[_traced(messages.locked_task(t)) for t in locked]
        )

    async def ExtendLease(
        self, request: external_task_pb2.ExtendLeaseRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.ExtendLeaseResponse:
        require_worker(current_caller.get(), request.worker_id)
        expires = await self._leases.extend(
            parse_uuid(request.task_id, "task_id"), request.worker_id, request.lease_token, request.lease_ms
        )
        return external_task_pb2.ExtendLeaseResponse(lease_expires_at=timestamp(expires))

    async def ReleaseLease(
        self, request: external_task_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.ReleaseLeaseResponse:
        require_worker(current_caller.get(), request.worker_id)
        await self._leases.release(
            parse_uuid(request.task_id, "task_id"), request.worker_id, request.lease_token, request.reason
        )
        return external_task_pb2.ReleaseLeaseResponse()

    async def Complete(
        self, request: external_task_pb2.CompleteRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.CompleteResponse:
        caller = current_caller.get()
        require_worker(caller, request.worker_id)
        fetch_next = request.fetch_next if request.HasField("fetch_next") else None
        # Checked before the completion, so a bad fetch_next changes nothing.
        subscriptions = _next_subscriptions(caller, request.worker_id, fetch_next, "fetch_next.")
        answer = await self._complete(request)
        answer.next_tasks.extend(
            await self._next_tasks(request.worker_id, subscriptions, request.fetch_next.max_tasks)
        )
        return answer

    async def CompleteTasks(
        self, request: external_task_pb2.CompleteTasksRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.CompleteTasksResponse:
        caller = current_caller.get()
        require_worker(caller, request.worker_id)
        _check_batch(request.worker_id, request.completions, "completions")
        for index, completion in enumerate(request.completions):
            if completion.HasField("fetch_next"):
                raise invalid(
                    ErrorReason.INVALID_ARGUMENT,
                    f"completions[{index}].fetch_next",
                    "set fetch_next on the batch, not on a completion",
                )
        fetch_next = request.fetch_next if request.HasField("fetch_next") else None
        subscriptions = _next_subscriptions(caller, request.worker_id, fetch_next, "fetch_next.")
        # Each completion on its own, all at once: those that reach the database together share its
        # group commit, and one refused leaves the others as they would be without it.
        outcomes = await self._each_or_refused(
            request.completions, request.worker_id, self._complete, "ExternalTaskHandler.CompleteTasks"
        )
        return external_task_pb2.CompleteTasksResponse(
            results=[_batch_result(external_task_pb2.CompletionResult(), o, "completed") for o in outcomes],
            next_tasks=await self._next_tasks(request.worker_id, subscriptions, request.fetch_next.max_tasks),
        )

    async def _complete(
        self, request: external_task_pb2.CompleteRequest
    ) -> external_task_pb2.CompleteResponse:
        # Worker (and so model) data that conditions and the output schema will read: bounded like Start's,
        # and a large one worked on only in its turn (`large_value_turn`).
        size = request.variables.ByteSize()
        async with large_value_turn(size):
            # Reading a large value (tens of milliseconds for thousands of objects) runs on the bounded
            # executor: on the event loop it would hold every other caller's call for that long.
            variables = await run_cpu_work(size >= LARGE_VALUE_BYTES, _stored_variables, request.variables)
            result = await self._completions.complete(
                parse_uuid(request.task_id, "task_id"),
                request.worker_id,
                request.lease_token,
                variables,
                _metadata(request.metadata),
                request.invalid_output_reason,
                large_output=size >= LARGE_VALUE_BYTES,
            )
        return external_task_pb2.CompleteResponse(
            outcome=_OUTCOMES.get(
                (result.verdict, result.routed), external_task_pb2.COMPLETE_OUTCOME_INCIDENT_RAISED
            ),
            next_node_id=result.next_node_id,
            incident_id=str(result.incident_id) if result.incident_id else "",
            reason=result.reason,
        )

    async def _next_tasks(
        self, worker_id: str, subscriptions: list[Subscription], max_tasks: int
    ) -> list[external_task_pb2.ExternalTask]:
        """Eager dispatch, on the topics `_next_subscriptions` checked: none asked for, none locked."""
        if not subscriptions:
            return []
        locked = await self._leases.fetch_and_lock(worker_id, subscriptions, max_tasks, 0)
        return [_traced(messages.locked_task(t), new_trace=True) for t in locked]

    async def Fail(
        self, request: external_task_pb2.FailRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.FailResponse:
        require_worker(current_caller.get(), request.worker_id)
        result = await self._completions.fail(
            parse_uuid(request.task_id, "task_id"),
            request.worker_id,
            request.lease_token,
            request.error_code,
            request.error_message,
            from_struct(request.error_details),
            request.no_retry,
            transient=request.transient,
            retry_after_ms=request.retry_after_ms,
        )
        return external_task_pb2.FailResponse(
            will_retry=result.will_retry,
            retry_at=timestamp(result.retry_at),
            incident_id=str(result.incident_id) if result.incident_id else "",
        )

    async def AwaitApproval(
        self, request: external_task_pb2.AwaitApprovalRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.AwaitApprovalResponse:
        require_worker(current_caller.get(), request.worker_id)
        opened = await self._approvals.park(
            parse_uuid(request.task_id, "task_id"), request.worker_id, request.lease_token
        )
        return external_task_pb2.AwaitApprovalResponse(approval_ids=[str(i) for i in opened])

    async def ReportDependency(
        self, request: external_task_pb2.ReportDependencyRequest, context: grpc.aio.ServicerContext
    ) -> external_task_pb2.ReportDependencyResponse:
        require_worker(current_caller.get(), request.worker_id)
        kind = messages.DEPENDENCY_KIND_NAMES.get(request.dependency.kind)
        if kind is None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "dependency.kind", "name the kind of dependency")
        if request.retry_after_ms < 0:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "retry_after_ms", "cannot be negative")
        decision = await self._dependencies.report(
            Report(
                task_id=parse_uuid(request.task_id, "task_id"),
                worker_id=request.worker_id,
                lease_token=request.lease_token,
                kind=kind,
                name=request.dependency.name,
                up=request.up,
                error=request.error_message,
                # An hour at most: a longer wait is an outage budget's business, not a probe time's.
                retry_after_seconds=min(request.retry_after_ms, 3_600_000) / 1000,
                not_called=request.not_called,
                wait_in_place=request.wait_in_place,
            )
        )
        return external_task_pb2.ReportDependencyResponse(
            action=_DEPENDENCY_ACTIONS[decision.action],
            retry_time=timestamp(decision.retry_at),
            incident_id=str(decision.incident_id) if decision.incident_id else "",
            probe=decision.probe,
        )


def _stored_variables(variables: struct_pb2.Struct) -> dict[str, Any]:
    """A completion's variables as the engine stores them, refused when too large or unstorable."""
    return storable(from_struct(variables, "variables"), "variables", MAX_VARIABLES_BYTES)
