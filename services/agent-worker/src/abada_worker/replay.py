"""Replay: rebuild the conversation from the journal and decide what to do next, as a pure function.

Finished steps are never paid for twice: a COMPLETED model call is replayed from its stored
reply and a finished tool call from its stored result. For each function call the model asked for,
the latest non-abandoned tool step carrying that call id decides:

- COMPLETED or FAILED: its stored result goes back to the model (FAILED as a tool error);
- STARTED, a read (a batch of parallel calls starts its reads to keep call order): run it again
  and finish the step at its own sequence;
- STARTED, a write whose server honours an idempotency key: re-send with the same key (and the
  arguments it was journaled with) and complete the step at its own sequence;
- AWAITING_APPROVAL: proposed and handed to a person, not decided yet: wait again;
- APPROVED: run it now, with the arguments as approved (a rejection is a COMPLETED tool error);
- OUTCOME_UNKNOWN and abandoned (a person said it did not happen), or no step at all: call it now;
- anything else (an unresolved OUTCOME_UNKNOWN, a STARTED write without a key): stop; only a
  person may decide whether that write happened.

A model call left STARTED by a dead attempt is not part of the conversation; it is simply run
again at the next free sequence, and the engine marks the orphan abandoned.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from . import step_payloads
from .conversation import FunctionCall, FunctionResult, ToolResults, Turn
from .prompt import RenderedPrompt, function_name, render_prompt
from .work import AgentWork, JournalEntry, StepKind, StepState, ToolBinding


@dataclass(frozen=True)
class Resend:
    """A call left STARTED by an earlier attempt: send again (a keyed write with this key), complete at
    this sequence."""

    sequence: int
    idempotency_key: str


@dataclass(frozen=True)
class PlannedCall:
    # The call as it is to run: a re-sent or approved call carries the arguments of its journal step.
    call: FunctionCall
    # Known from the journal; None means the call still has to happen.
    result: FunctionResult | None = None
    resend: Resend | None = None
    # A call of a tool under approval: a person approved it (its arguments are the approved ones),
    # or it already waits for a decision at this sequence.
    approved: bool = False
    awaiting_at: int | None = None


@dataclass(frozen=True)
class CallModel:
    """Every round so far is complete: ask the model for its next turn."""


@dataclass(frozen=True)
class RunCalls:
    """The last model turn's calls, in its order; the ones with a result are already done."""

    calls: tuple[PlannedCall, ...]


@dataclass(frozen=True)
class Finish:
    """The last model turn asked for no function: its text is the answer (unless it refused)."""

    text: str
    refusal: str = ""


@dataclass(frozen=True)
class Blocked:
    reason: str


NextAction = CallModel | RunCalls | Finish | Blocked


@dataclass(frozen=True)
class Usage:
    model_calls: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    tools_used: tuple[str, ...] = ()
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True)
class ReplayPlan:
    prompt: RenderedPrompt
    # What the model has seen, oldest first; with RunCalls it ends with the turn whose calls are due.
    history: tuple[Turn, ...]
    next_action: NextAction
    next_sequence: int
    usage: Usage


def bound_functions(work: AgentWork) -> dict[str, ToolBinding]:
    return {function_name(binding): binding for binding in work.bindings}


def plan_replay(work: AgentWork, variables: Mapping[str, Any], steps: Sequence[JournalEntry]) -> ReplayPlan:
    ordered = sorted(steps, key=lambda step: step.sequence)
    functions = bound_functions(work)
    by_ref = {binding.ref: binding for binding in work.bindings}
    model_steps = [
        step
        for step in ordered
        if step.kind is StepKind.MODEL_CALL and step.state is StepState.COMPLETED and not step.abandoned
    ]
    history: list[Turn] = []
    next_action: NextAction = CallModel()
    for index, model_step in enumerate(model_steps):
        turn = step_payloads.model_turn_of(model_step.response)
        history.append(turn)
        last = index == len(model_steps) - 1
        if not turn.function_calls:
            if last:
                next_action = Finish(turn.text, turn.refusal)
            continue
        window_end = model_steps[index + 1].sequence if not last else None
        tool_steps = _latest_tool_steps(ordered, model_step.sequence, window_end)
        planned = [
            _plan_call(call, tool_steps.get(call.id), functions, by_ref) for call in turn.function_calls
        ]
        blocked = next((item for item in planned if isinstance(item, Blocked)), None)
        if blocked is not None:
            next_action = blocked
            break
        calls = [item for item in planned if isinstance(item, PlannedCall)]
        if all(call.result is not None for call in calls):
            history.append(ToolResults(tuple(call.result for call in calls if call.result is not None)))
        elif last:
            next_action = RunCalls(tuple(calls))
        else:
            missing = [call.call.id for call in calls if call.result is None]
            next_action = Blocked(
                f"journal inconsistent: the model call at sequence {model_step.sequence} was followed by "
                f"another model call, yet its function calls {missing} have no finished tool step"
            )
            break
    return ReplayPlan(
        prompt=render_prompt(work, variables),
        history=tuple(history),
        next_action=next_action,
        next_sequence=(ordered[-1].sequence + 1) if ordered else 1,
        usage=_usage(ordered),
    )


def _latest_tool_steps(
    ordered: Sequence[JournalEntry], after: int, before: int | None
) -> dict[str, JournalEntry]:
    latest: dict[str, JournalEntry] = {}
    for step in ordered:
        if step.kind is not StepKind.TOOL_CALL or step.abandoned or step.sequence <= after:
            continue
        if before is not None and step.sequence >= before:
            break
        latest[step_payloads.call_id_of(step.request)] = step
    return latest


def _plan_call(
    call: FunctionCall,
    step: JournalEntry | None,
    functions: Mapping[str, ToolBinding],
    by_ref: Mapping[str, ToolBinding],
) -> PlannedCall | Blocked:
    if call.name not in functions:
        result = step_payloads.unknown_function_result(call.name, frozenset(functions))
        return PlannedCall(call, FunctionResult(call.id, call.name, result, is_error=True))
    if step is None:
        return PlannedCall(call)
    if step.state in (StepState.COMPLETED, StepState.FAILED):
        failed = step.state is StepState.FAILED or bool(step.response.get("isError"))
        return PlannedCall(call, FunctionResult(call.id, call.name, step.response, is_error=failed))
    binding = by_ref.get(step.tool_ref) or functions[call.name]
    if step.state is StepState.AWAITING_APPROVAL:
        return PlannedCall(call, awaiting_at=step.sequence)
    if step.state is StepState.APPROVED:
        approved = step_payloads.approved_arguments_of(step.response)
        if approved is None:
            return Blocked(
                f"the approval of {step.tool_ref} at sequence {step.sequence} carries no arguments"
            )
        return PlannedCall(replace(call, args=approved), approved=True)
    if step.state is StepState.STARTED:
        # Run again with the arguments it was journaled with (a person may have edited them).
        journaled = step.request.get("arguments")
        call = replace(call, args=dict(journaled)) if isinstance(journaled, dict) else call
        if not binding.is_write:
            # A read a parallel batch had started: run it again and finish it at its own sequence.
            return PlannedCall(call, resend=Resend(step.sequence, ""))
        if binding.keyed and step.idempotency_key:
            return PlannedCall(call, resend=Resend(step.sequence, step.idempotency_key))
        return Blocked(
            f"the write {step.tool_ref} at sequence {step.sequence} was started without an idempotency key "
            "and may have happened; it must not be sent again"
        )
    # OUTCOME_UNKNOWN: abandoned steps were skipped above, so nobody has said whether it happened yet.
    return Blocked(
        f"the outcome of {step.tool_ref} at sequence {step.sequence} is unknown and not yet resolved"
    )


def _usage(ordered: Sequence[JournalEntry]) -> Usage:
    model_calls = tool_calls = input_tokens = output_tokens = cached = reasoning = 0
    tools_used: list[str] = []
    for step in ordered:
        input_tokens += step.input_tokens
        output_tokens += step.output_tokens
        if step.kind is StepKind.MODEL_CALL and step.state is StepState.COMPLETED:
            step_cached, step_reasoning = step_payloads.usage_of(step.response)
            cached += step_cached
            reasoning += step_reasoning
        if step.abandoned:
            continue
        if step.kind is StepKind.MODEL_CALL and step.state is StepState.COMPLETED:
            model_calls += 1
        elif step.kind is StepKind.TOOL_CALL and step.state in (StepState.COMPLETED, StepState.FAILED):
            tool_calls += 1
            if step.tool_ref not in tools_used:
                tools_used.append(step.tool_ref)
    return Usage(model_calls, tool_calls, input_tokens, output_tokens, tuple(tools_used), cached, reasoning)
