"""The agent loop for one task of topic `abada:agent`: replay, tools, model turns, the answer.

1. Rebuild the conversation from the journal (`replay`); finished steps are not paid for again.
2. Open the bound tool servers with credentials from the broker and check their contract.
3. Alternate model turns and the function calls they ask for, journaling each step.
4. A turn without function calls is the answer: Complete with the result variable and metadata.

A call of a tool under `approval: required` is journaled AWAITING_APPROVAL instead of sent; once
the turn's other calls ran, the task is handed back to wait for a person (the engine parks it and
takes the lease). Offered again after every call of the turn is decided, the journal replays up to
that turn (no model turn paid twice) and the approved calls run with the arguments as approved.

A dependency that fails for a reason that passes (the provider overloaded, a tool server restarting,
the broker or its secret store away) costs time, not the attempt: every call to one goes through the
attempt's `DependencyWatch`, which waits the outage out as the engine directs or ends the attempt
with the task parked (`dependencies`).

Every way the attempt can end early is an exception from `errors`; the executor reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from abada.engine.v1 import external_task_pb2
from abada_common.struct_codec import from_struct

from .answer import InvalidAnswer, parse_answer
from .broker_client import BrokerClient
from .conversation import FunctionCall, FunctionResult, ModelReply, ModelRequest, ModelTurn, ToolResults, Turn
from .dependencies import (
    BROKER,
    SECRET_STORE,
    Dependency,
    DependencyDown,
    DependencyWatch,
    Verdict,
    model,
    tool_server,
)
from .engine_client import EngineClient, LeaseRef
from .errors import AttemptFailed, QuotaWait
from .fault import FaultPlan
from .gen_ai_spans import gen_ai_span
from .interruption import TaskInterruption
from .journal import Journal
from .logs import TaskLog
from .metrics import observe_model_call
from .outage import until_the_engine_takes_it
from .prompt import RenderedPrompt
from .providers.base import CREDENTIAL_STATUSES, QUOTA_STATUS, ModelCallError, ModelProvider, is_outage
from .providers.registry import ProviderSet
from .replay import Blocked, CallModel, Finish, PlannedCall, ReplayPlan, RunCalls, Usage, plan_replay
from .tool_batch import ToolBatch
from .toolbox import Toolbox
from .work import AGENT_PROFILE, AgentWork, agent_work_from_proto, journal_entry_from_proto

log = logging.getLogger(__name__)

# What the engine keeps of an answer it could not parse, for the person who reviews it.
_MAX_INVALID_OUTPUT_CHARS = 8_000


@dataclass(frozen=True)
class AgentServices:
    engine: EngineClient
    broker: BrokerClient
    providers: ProviderSet
    tool_timeout_seconds: float = 60.0
    # How many of one model turn's function calls run at once (per task).
    tool_call_concurrency: int = 4
    # The worker's lease length: a lease that ran out during an engine outage is renewed with it.
    lease_ms: int = 0
    fault: FaultPlan = field(default_factory=FaultPlan)


@dataclass
class Tally:
    """What the whole task has spent so far, the journaled earlier attempts included."""

    model_calls: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tools_used: list[str] = field(default_factory=list)
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0

    @classmethod
    def of(cls, usage: Usage) -> Tally:
        return cls(
            usage.model_calls,
            usage.tool_calls,
            usage.input_tokens,
            usage.output_tokens,
            list(usage.tools_used),
            usage.cached_input_tokens,
            usage.reasoning_tokens,
        )

    def add_model_turn(self, reply: ModelReply) -> None:
        self.model_calls += 1
        self.input_tokens += reply.input_tokens
        self.output_tokens += reply.output_tokens
        self.cached_input_tokens += reply.cached_input_tokens
        self.reasoning_tokens += reply.reasoning_tokens

    def add_tool(self, ref: str) -> None:
        self.tool_calls += 1
        if ref not in self.tools_used:
            self.tools_used.append(ref)


def lease_of(task: external_task_pb2.ExternalTask) -> LeaseRef:
    return LeaseRef(task_id=task.id, lease_token=task.lease_token, attempt=task.attempt)


class AgentTask:
    def __init__(
        self, services: AgentServices, task: external_task_pb2.ExternalTask, interruption: TaskInterruption
    ) -> None:
        self._services = services
        self._task = task
        self._lease = lease_of(task)
        self._interruption = interruption
        self._started = time.monotonic()
        self._quota_wait_ms = 0
        self._log = TaskLog(log, {"task_id": task.id, "attempt": task.attempt})
        self._provider: ModelProvider | None = None
        probes = (Dependency.from_proto(probe) for probe in task.probes)
        self._watch = DependencyWatch(
            self._report_dependency, interruption, self._log, [p for p in probes if p is not None]
        )

    async def run(self) -> None:
        try:
            await self._run()
        except DependencyDown as down:
            # A call no other place waits out (each does where it can wait in place): park the task.
            await self._watch.stop_for(down)

    async def _run(self) -> None:
        work = agent_work_from_proto(self._task.agent_work)
        if work.profile_version != AGENT_PROFILE:
            raise AttemptFailed(
                "UNSUPPORTED_PROFILE",
                f"this worker runs agent profile {AGENT_PROFILE}, not {work.profile_version!r}",
                no_retry=True,
            )
        self._provider = self._services.providers.for_node(work.provider, work.model)
        variables = from_struct(self._task.variables)
        plan = plan_replay(work, variables, [journal_entry_from_proto(step) for step in self._task.steps])
        self._log.info(
            "task started",
            extra={"replayed_steps": len(self._task.steps), "next_action": type(plan.next_action).__name__},
        )
        if isinstance(plan.next_action, Blocked):
            raise AttemptFailed("JOURNAL_BLOCKED", plan.next_action.reason, no_retry=True)
        tally = Tally.of(plan.usage)
        action = plan.next_action
        answer = action if isinstance(action, Finish) else await self._converse(work, plan, tally)
        if answer is None:
            return  # handed back to wait for a person's approval
        self._services.fault.boundary("before-complete")
        await self._complete(work, plan.prompt, answer, tally)

    async def _converse(self, work: AgentWork, plan: ReplayPlan, tally: Tally) -> Finish | None:
        """Model turns and the calls they ask for, from where the journal left off, to the final turn
        (None: the task was handed back to wait for approvals)."""
        journal = Journal(
            self._services.engine,
            self._lease,
            plan.next_sequence,
            self._interruption,
            self._services.lease_ms,
        )
        history = list(plan.history)
        action = plan.next_action
        toolbox_open, toolbox = await self._watch.call(lambda: self._open_toolbox(work), needs=needs_of(work))
        async with toolbox_open:
            while not isinstance(action, Finish):
                if isinstance(action, RunCalls):
                    turn = history[-1]
                    turn_text = turn.text if isinstance(turn, ModelTurn) else ""
                    try:
                        results, waiting = await self._run_calls(
                            action.calls, toolbox, journal, tally, turn_text
                        )
                    except DependencyDown as down:
                        if down.not_called:
                            raise
                        # The session broke in the middle of a turn: resume from the journal when offered again.
                        await self._watch.stop_for(down)
                    if waiting:
                        await self._hand_back_for_approval(waiting)
                        return None
                    history.append(ToolResults(results))
                    action = CallModel()
                else:
                    turn = await self._call_model(work, plan.prompt, history, toolbox, journal, tally)
                    history.append(turn)
                    calls = tuple(PlannedCall(call) for call in turn.function_calls)
                    action = RunCalls(calls) if calls else Finish(turn.text, turn.refusal)
        return action

    async def _open_toolbox(self, work: AgentWork) -> tuple[contextlib.AsyncExitStack, Toolbox]:
        """The bound servers' sessions, open and checked, on a stack the caller closes."""
        stack = contextlib.AsyncExitStack()
        services = self._services
        try:
            toolbox = await stack.enter_async_context(
                Toolbox.open(
                    work,
                    self._lease,
                    services.broker,
                    timeout_seconds=services.tool_timeout_seconds,
                    fault=services.fault,
                )
            )
        except BaseException:
            await stack.aclose()
            raise
        return stack, toolbox

    async def _report_dependency(
        self, dependency: Dependency, *, up: bool, failure: DependencyDown | None, wait_in_place: bool
    ) -> Verdict:
        """Tells the engine, through its own outages too, what a call to a dependency met."""
        engine = self._services.engine
        return await until_the_engine_takes_it(
            lambda: engine.report_dependency(
                self._lease, dependency, up=up, failure=failure, wait_in_place=wait_in_place
            ),
            self._interruption,
            renew=self._renewal(),
            what="dependency report",
        )

    async def _call_model(
        self,
        work: AgentWork,
        prompt: RenderedPrompt,
        history: list[Turn],
        toolbox: Toolbox,
        journal: Journal,
        tally: Tally,
    ) -> ModelTurn:
        self._interruption.checkpoint()
        turn_index = sum(1 for turn in history if isinstance(turn, ModelTurn))
        provider = self._provider
        assert provider is not None, "run() chooses the provider before any model turn"
        request = ModelRequest(work.model, prompt.system, prompt.user, tuple(history), toolbox.functions)
        estimate = estimated_tokens(request)
        while True:
            try:
                sequence = await self._watch.call(
                    lambda: journal.start_model_call(turn_index, work.model, provider.name, estimate)
                )
                break
            except QuotaWait as wait:
                await self._wait_for_quota(wait)
        while True:
            try:
                reply = await self._watch.call(
                    lambda: self._generate(provider, work, request, sequence), needs=(model(work.model),)
                )
                break
            except ModelCallError as error:
                if error.status == QUOTA_STATUS and error.retryable:
                    # The provider's own quota: the same wait, the same STARTED step, no failed attempt.
                    # (OpenAI's insufficient_quota is a 429 too, but not retryable: no wait clears it.)
                    await self._wait_for_quota(
                        QuotaWait(error.retry_after_seconds or 1.0, str(error), provider.name)
                    )
                    continue
                # A refusal of the request or of the credential: no retry can change it.
                await journal.fail_model_call(sequence, str(error))
                raise refused_model_call(provider, error) from None
        reply = assign_call_ids(reply, sequence)
        too_large = await journal.finish_model_call(sequence, reply)
        if too_large is not None:
            # Journaled truncated with its real tokens (the budget counts them); asking again would
            # pay for the same oversized answer again.
            raise AttemptFailed(
                "MODEL_REPLY_TOO_LARGE",
                f"the model's reply was {too_large} bytes, more than the journal takes; "
                "it was journaled truncated and is not asked again",
                no_retry=True,
                details={"bytes": too_large, "sequence": sequence},
            )
        self._services.fault.boundary("model-returned")
        tally.add_model_turn(reply)
        self._log.info(
            "model turn",
            extra={
                "sequence": sequence,
                "function_calls": [call.name for call in reply.function_calls],
                "input_tokens": reply.input_tokens,
                "output_tokens": reply.output_tokens,
            },
        )
        return reply.as_turn()

    async def _wait_for_quota(self, wait: QuotaWait) -> None:
        """Waits as told, with the lease kept alive by the executor; a drain may end the wait at once."""
        self._log.info(
            "waiting for model quota",
            extra={
                "source": wait.source,
                "wait_seconds": round(wait.retry_after_seconds, 3),
                "reason": str(wait),
            },
        )
        began = time.monotonic()
        try:
            await asyncio.sleep(wait.retry_after_seconds)
        finally:
            self._quota_wait_ms += int((time.monotonic() - began) * 1000)
        self._interruption.checkpoint()

    async def _generate(
        self, provider: ModelProvider, work: AgentWork, request: ModelRequest, sequence: int
    ) -> ModelReply:
        """One provider call in its GenAI span, its latency and tokens counted by model."""
        began = time.monotonic()
        try:
            with gen_ai_span(
                "chat",
                work.model,
                {
                    "gen_ai.request.model": work.model,
                    "gen_ai.provider.name": provider.name,
                    "abada.journal.sequence": sequence,
                },
            ) as span:
                reply = await provider.generate(request)
                span.set_attribute("gen_ai.usage.input_tokens", reply.input_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", reply.output_tokens)
        except ModelCallError as error:
            observe_model_call(work.model, time.monotonic() - began, 0, 0, failed=True)
            if is_outage(error):
                raise DependencyDown(
                    model(work.model), str(error), retry_after_seconds=error.retry_after_seconds or 0.0
                ) from None
            raise
        observe_model_call(work.model, time.monotonic() - began, reply.input_tokens, reply.output_tokens)
        return reply

    async def _run_calls(
        self, calls: tuple[PlannedCall, ...], toolbox: Toolbox, journal: Journal, tally: Tally, turn_text: str
    ) -> tuple[tuple[FunctionResult, ...], tuple[int, ...]]:
        """The turn's results, in call order, and the sequences of its calls waiting for approval."""
        batch = ToolBatch(
            toolbox,
            journal,
            self._interruption,
            self._log,
            concurrency=self._services.tool_call_concurrency,
            fault=self._services.fault,
            watch=self._watch,
        )
        outcome = await batch.run(calls, turn_text)
        for ref in outcome.tools_called:
            tally.add_tool(ref)
        return outcome.results, outcome.waiting

    async def _hand_back_for_approval(self, waiting: tuple[int, ...]) -> None:
        """The engine parks the task (no lease, not fetchable) and opens one approval per waiting call."""
        reply = await self._services.engine.await_approval(self._lease)
        self._log.info(
            "task handed back to wait for approval",
            extra={"waiting_sequences": list(waiting), "approval_ids": list(reply.approval_ids)},
        )

    def _renewal(self) -> Callable[[], Awaitable[None]] | None:
        """Renews this task's lease (the engine re-grants one that ran out if nobody took over)."""
        lease_ms = self._services.lease_ms
        if not lease_ms:
            return None
        engine = self._services.engine

        async def renew() -> None:
            await engine.extend_lease(self._lease, lease_ms)

        return renew

    async def _complete(self, work: AgentWork, prompt: RenderedPrompt, finish: Finish, tally: Tally) -> None:
        invalid_reason = ""
        confidence: float | None = None
        text = finish.text
        try:
            if finish.refusal:
                # A refusal is the model's last word, not an answer; a person reviews it.
                text = finish.refusal
                raise InvalidAnswer(f"the model refused: {finish.refusal[:500]}")
            answer = parse_answer(text)
            variables: dict[str, Any] = {work.result_variable: answer.value}
            confidence = answer.confidence
        except InvalidAnswer as invalid:
            invalid_reason = str(invalid)
            variables = {work.result_variable: text[:_MAX_INVALID_OUTPUT_CHARS]}
        provider = self._provider
        metadata = external_task_pb2.AttemptMetadata(
            model=work.model,
            provider=provider.name if provider is not None else work.provider,
            input_tokens=tally.input_tokens,
            output_tokens=tally.output_tokens,
            tools_used=tally.tools_used,
            duration_ms=int((time.monotonic() - self._started) * 1000),
            prompt_hash=prompt.hash,
            model_calls=tally.model_calls,
            tool_calls=tally.tool_calls,
            quota_wait_ms=self._quota_wait_ms,
            cached_input_tokens=tally.cached_input_tokens,
            reasoning_tokens=tally.reasoning_tokens,
        )
        if confidence is not None:
            metadata.confidence = confidence
        engine = self._services.engine
        with self._interruption.side_effect():
            reply = await until_the_engine_takes_it(
                lambda: engine.complete(self._lease, variables, metadata, invalid_reason),
                self._interruption,
                renew=self._renewal(),
                what="answer",
            )
        self._log.info(
            "task completed",
            extra={
                "outcome": external_task_pb2.CompleteOutcome.Name(reply.outcome),
                "next_node_id": reply.next_node_id,
                "reason": reply.reason,
                "invalid_output": bool(invalid_reason),
            },
        )


def refused_model_call(provider: ModelProvider, error: ModelCallError) -> AttemptFailed:
    """The incident for a model call the provider refused (not an outage): a rejected credential is
    named as such, with where the worker reads it from."""
    details = {"status": error.status, "provider": provider.name}
    if error.status in CREDENTIAL_STATUSES:
        return AttemptFailed(
            "MODEL_CREDENTIAL_REJECTED",
            f"{provider.name} rejected the worker's credential ({provider.credential}): {error}",
            no_retry=True,
            details={**details, "credential": provider.credential},
        )
    return AttemptFailed("MODEL_CALL_FAILED", str(error), no_retry=True, details=details)


def needs_of(work: AgentWork) -> tuple[Dependency, ...]:
    """What opening the node's tool sessions shows to be answering: each bound server, and the broker
    and its secret store when a server needs a credential."""
    servers = work.servers()
    needs = [tool_server(name) for name in servers]
    if any(bindings[0].credential for bindings in servers.values()):
        needs += [BROKER, SECRET_STORE]
    return tuple(needs)


def assign_call_ids(reply: ModelReply, sequence: int) -> ModelReply:
    """Gives every function call an id unique in its turn; replay matches tool steps to calls by it.

    Gemini often sends no id at all; the model's own (empty) id is kept to show it back unchanged.
    """
    seen: set[str] = set()
    calls: list[FunctionCall] = []
    changed = False
    for index, call in enumerate(reply.function_calls):
        if not call.id or call.id in seen:
            call = FunctionCall(
                f"call_{sequence}_{index}", call.name, call.args, call.signature, provider_id=call.id
            )
            changed = True
        seen.add(call.id)
        calls.append(call)
    if not changed:
        return reply
    return dataclasses.replace(reply, function_calls=tuple(calls))


def estimated_tokens(request: ModelRequest) -> int:
    """The request's size in tokens, roughly (four characters a token): the engine counts it against
    the model's tokens-per-minute quota until the reply brings the real count."""
    size = len(request.system) + len(request.user)
    size += sum(len(repr(turn)) for turn in request.history)
    size += sum(
        len(spec.name) + len(spec.description) + len(json.dumps(spec.parameters))
        for spec in request.functions
    )
    return max(1, size // 4)
