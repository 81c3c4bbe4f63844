"""What the journal accepts: pure checks on a step, its binding and the node's limits (no I/O)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.db.database import dumps
from abada_engine.definitions.model import Limits, ToolBinding
from abada_engine.errors import Category, EngineError, invalid, precondition
from abada_engine.runtime.views import StepContent, StepView
from abada_engine.store.journal_steps import AppendContext
from abada_engine.store.states import WORKER_STEP_STATES, StepKind, StepState

MAX_PAYLOAD_BYTES = 1_000_000


@dataclass(frozen=True)
class StepRequest(StepContent):
    """A step a worker asks to append, with the task and the lease it claims to hold."""

    task_id: uuid.UUID
    worker_id: str
    lease_token: str


def check_shape(step: StepRequest) -> None:
    if step.kind not in tuple(StepKind):
        raise invalid(ErrorReason.INVALID_ARGUMENT, "kind", "must be MODEL_CALL or TOOL_CALL")
    if step.state not in WORKER_STEP_STATES:
        raise invalid(
            ErrorReason.INVALID_ARGUMENT,
            "state",
            "must be STARTED, COMPLETED, FAILED or AWAITING_APPROVAL (OUTCOME_UNKNOWN and APPROVED are the engine's)",
        )
    if step.state == StepState.AWAITING_APPROVAL and step.kind != StepKind.TOOL_CALL:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "state", "only a tool call awaits approval")
    if step.sequence < 1:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "sequence", "starts at 1")
    if step.attempt < 1:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "attempt", "starts at 1")
    if step.input_tokens < 0 or step.output_tokens < 0:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "tokens", "cannot be negative")
    for name, value in (("request", step.request), ("response", step.response)):
        if value is not None and len(dumps(value)) > MAX_PAYLOAD_BYTES:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, name, f"is larger than {MAX_PAYLOAD_BYTES} bytes as JSON"
            )


def binding_for(step: StepRequest, bindings: dict[str, ToolBinding]) -> ToolBinding | None:
    if step.kind == StepKind.MODEL_CALL:
        if step.tool_ref:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "tool_ref", "a model call names no tool")
        if step.state != StepState.STARTED:
            # A finished model call finishes its own STARTED, where quota and budgets were checked:
            # one journaled finished at a new sequence would spend past both unseen.
            raise precondition(
                ErrorReason.MODEL_CALL_NOT_STARTED,
                f"sequence {step.sequence} holds no STARTED model call to finish: journal the call "
                "STARTED before making it",
                "state",
            )
        return None
    binding = bindings.get(step.tool_ref)
    if binding is None:
        raise precondition(
            ErrorReason.BINDING_NOT_FOUND,
            f"{step.tool_ref!r} is not a tool bound to this node (bound: {', '.join(sorted(bindings)) or 'none'})",
            "tool_ref",
        )
    if step.state == StepState.AWAITING_APPROVAL:
        if not binding.approval_required:
            raise precondition(
                ErrorReason.APPROVAL_NOT_REQUIRED,
                f"{step.tool_ref} is not under approval: call it instead of proposing it",
                "state",
            )
        if step.request is None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "request", "say which call awaits approval")
        return binding
    if binding.policy == "write" and step.state != StepState.STARTED:
        raise precondition(
            ErrorReason.WRITE_NOT_STARTED,
            f"{step.tool_ref} is a write: journal it STARTED before calling it",
            "state",
        )
    return binding


def check_limits(step: StepRequest, counts: AppendContext, limits: Limits) -> None:
    if step.kind == StepKind.MODEL_CALL:
        calls = counts.model_calls + 1
        if calls > limits.max_model_calls:
            raise _limit(
                "max_model_calls", f"model call {calls} exceeds max_model_calls {limits.max_model_calls}"
            )
        if counts.tokens >= limits.max_tokens:
            raise _limit("max_tokens", f"{counts.tokens} tokens spent reach max_tokens {limits.max_tokens}")
    else:
        calls = counts.tool_calls + 1
        if calls > limits.max_tool_calls:
            raise _limit(
                "max_tool_calls", f"tool call {calls} exceeds max_tool_calls {limits.max_tool_calls}"
            )


def _limit(which: str, message: str) -> EngineError:
    return EngineError(
        Category.RESOURCE_EXHAUSTED,
        ErrorReason.LIMIT_EXCEEDED,
        message,
        field="sequence",
        metadata={"limit": which},
    )


def unkeyed_writes_in_flight(steps: list[StepView], bindings: list[ToolBinding]) -> list[StepView]:
    """STARTED writes without an idempotency key: sent, perhaps done, and never to be re-sent blindly."""
    by_ref = {b.ref: b for b in bindings}
    return [
        s
        for s in steps
        if s.kind == StepKind.TOOL_CALL
        and s.state == StepState.STARTED
        and not s.abandoned
        and (binding := by_ref.get(s.tool_ref)) is not None
        and binding.policy == "write"
        and binding.idempotency != "key"
    ]
