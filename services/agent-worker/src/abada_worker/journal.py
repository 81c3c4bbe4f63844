"""Writing the step journal of one attempt through AppendStep, one sequence after another.

Every model call and tool call, a read too, is journaled STARTED before it happens (the engine
checks the limits there, so nothing past them is ever sent) and moved to COMPLETED or FAILED at the
same sequence after.
The payload shapes are in `step_payloads`. Every append outlasts an engine outage (`outage`): a
step that was paid for is journaled before anything new begins.
"""

from __future__ import annotations

from typing import Any

from abada.engine.v1 import external_task_pb2
from abada_common.struct_codec import to_struct

from . import step_payloads
from .conversation import FunctionCall, ModelReply
from .engine_client import EngineClient, LeaseRef
from .interruption import TaskInterruption
from .outage import until_the_engine_takes_it
from .work import StepKind, StepState

_MODEL_REF = ""


class Journal:
    def __init__(
        self,
        engine: EngineClient,
        lease: LeaseRef,
        next_sequence: int,
        interruption: TaskInterruption | None = None,
        lease_ms: int = 0,
    ) -> None:
        self._engine = engine
        self._lease = lease
        self._next = next_sequence
        self._interruption = interruption or TaskInterruption()
        self._lease_ms = lease_ms

    @property
    def next_sequence(self) -> int:
        return self._next

    async def start_model_call(self, turn: int, model: str, provider: str, estimated_tokens: int = 0) -> int:
        """Journals the model call STARTED; the engine admits it against the model's quota there, given
        the request's estimated size. Refused for quota (QuotaWait), the sequence stays free for the
        same call to ask again."""
        sequence = self._next
        await self._append(
            sequence,
            StepKind.MODEL_CALL,
            StepState.STARTED,
            _MODEL_REF,
            request=step_payloads.model_request(turn, model, provider),
            tokens=(estimated_tokens, 0) if estimated_tokens else None,
        )
        return self._taken(sequence)

    async def finish_model_call(self, sequence: int, reply: ModelReply) -> int | None:
        """Journals the reply with its real tokens; a reply larger than the journal takes is journaled
        truncated (still COMPLETED: it was paid for) and its full size returned, else None."""
        response, too_large = step_payloads.model_response_within_limit(reply)
        await self._append(
            sequence,
            StepKind.MODEL_CALL,
            StepState.COMPLETED,
            _MODEL_REF,
            response=response,
            tokens=(reply.input_tokens, reply.output_tokens),
        )
        return too_large

    async def fail_model_call(self, sequence: int, message: str) -> None:
        await self._append(
            sequence, StepKind.MODEL_CALL, StepState.FAILED, _MODEL_REF, response={"error": message}
        )

    async def start_read(self, call: FunctionCall, tool_ref: str) -> int:
        """Takes a read's sequence before it runs: the engine counts it against the node's limits first,
        and parallel calls keep their call order in the journal."""
        sequence = self._next
        await self._append(
            sequence,
            StepKind.TOOL_CALL,
            StepState.STARTED,
            tool_ref,
            request=step_payloads.tool_request(call),
        )
        return self._taken(sequence)

    async def finish_read(self, sequence: int, tool_ref: str, result: dict[str, Any]) -> None:
        await self._append(sequence, StepKind.TOOL_CALL, _finished_state(result), tool_ref, response=result)

    async def propose_call(self, call: FunctionCall, tool_ref: str, model_text: str) -> int:
        """Journals a call of a tool under approval as AWAITING_APPROVAL: proposed, not sent."""
        sequence = self._next
        await self._append(
            sequence,
            StepKind.TOOL_CALL,
            StepState.AWAITING_APPROVAL,
            tool_ref,
            request=step_payloads.proposed_call_request(call, model_text),
        )
        return self._taken(sequence)

    async def start_write(self, call: FunctionCall, tool_ref: str) -> tuple[int, str]:
        """Journals the write before it happens; returns its sequence and the engine's idempotency key ("" if none)."""
        sequence = self._next
        reply = await self._append(
            sequence,
            StepKind.TOOL_CALL,
            StepState.STARTED,
            tool_ref,
            request=step_payloads.tool_request(call),
        )
        return self._taken(sequence), reply.idempotency_key or reply.step.idempotency_key

    async def finish_write(self, sequence: int, tool_ref: str, result: dict[str, Any]) -> None:
        await self._append(sequence, StepKind.TOOL_CALL, _finished_state(result), tool_ref, response=result)

    def _taken(self, sequence: int) -> int:
        """The engine journaled `sequence`: the next step takes the one after. A step it refused (a
        quota, a dependency that is down) leaves the sequence free for the same step to ask again."""
        self._next = sequence + 1
        return sequence

    async def _append(
        self,
        sequence: int,
        kind: StepKind,
        state: StepState,
        tool_ref: str,
        *,
        request: dict[str, Any] | None = None,
        response: dict[str, Any] | None = None,
        tokens: tuple[int, int] | None = None,
    ) -> external_task_pb2.AppendStepResponse:
        message = external_task_pb2.AppendStepRequest(
            task_id=self._lease.task_id,
            lease_token=self._lease.lease_token,
            attempt=self._lease.attempt,
            sequence=sequence,
            kind=kind.value,
            state=state.value,
            tool_ref=tool_ref,
        )
        if request is not None:
            message.request.CopyFrom(to_struct(request))
        if response is not None:
            message.response.CopyFrom(to_struct(response))
        if tokens is not None:
            message.tokens.CopyFrom(
                external_task_pb2.TokenUsage(input_tokens=tokens[0], output_tokens=tokens[1])
            )
        self._interruption.begun = True
        renew = None
        if self._lease_ms:

            async def renew() -> None:
                await self._engine.extend_lease(self._lease, self._lease_ms)

        return await until_the_engine_takes_it(
            lambda: self._engine.append_step(message), self._interruption, renew=renew, what="journal step"
        )


def _finished_state(result: dict[str, Any]) -> StepState:
    return StepState.FAILED if result.get("isError") else StepState.COMPLETED
