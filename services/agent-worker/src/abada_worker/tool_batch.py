"""One model turn's function calls: run together, journaled in call order, answered in call order.

This is the one place where an attempt runs tool calls concurrently. The rules are those of a single
call, applied to each call of the turn:

- every call gets its own journal sequence, in the order the model asked for them. The engine takes
  a task's steps one sequence after another, so when several calls are due, each is first journaled
  STARTED in call order (a write with its idempotency key, a read as a placeholder); then they run
  together, at most `concurrency` at a time, and each is journaled COMPLETED or FAILED at its own
  sequence as soon as it finishes;
- a turn with a single call due journals it STARTED, runs it, and finishes it: every call, a read
  too, is counted against the node's limits by the engine before it runs;
- the results go back to the model in call order, whatever order the calls finished in.

After a crash in the middle of a batch, replay decides per call exactly as for one call: a finished
call is replayed from the journal, a read left STARTED is run again and finished at its own
sequence, a keyed write left STARTED is re-sent with its key, and an unkeyed one is never re-sent
(the engine holds the task for a person).

A call of a tool under `approval: required` that no person approved yet is not run: it is journaled
AWAITING_APPROVAL (with the model's text of the turn) after the turn's other calls ran, and the
outcome lists it as waiting; the caller then hands the task back. An approved call runs like any
other, with the approved arguments.

A batch containing a write is one side effect: once its writes are journaled STARTED, all of them
are sent and journaled even if the worker is asked to stop meanwhile. A batch of reads may be cut off
at any moment; the reads are cheap to run again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .conversation import FunctionResult
from .dependencies import DependencyWatch
from .fault import FaultPlan
from .interruption import TaskInterruption
from .journal import Journal
from .logs import TaskLog
from .replay import PlannedCall
from .step_payloads import unknown_function_result
from .toolbox import Toolbox
from .work import ToolBinding

Started = TypeVar("Started")


@dataclass(frozen=True)
class _Reserved:
    """A call of the batch with its journal sequence taken (and, for a keyed write, its key)."""

    index: int
    planned: PlannedCall
    binding: ToolBinding
    sequence: int
    idempotency_key: str


@dataclass(frozen=True)
class BatchOutcome:
    # In call order; empty while calls wait for approval (the model hears back once all are decided).
    results: tuple[FunctionResult, ...]
    # The bound tools called in this batch, in call order (for the attempt metadata).
    tools_called: tuple[str, ...]
    # The journal sequences of the calls waiting for a person's approval.
    waiting: tuple[int, ...] = ()


class ToolBatch:
    def __init__(
        self,
        toolbox: Toolbox,
        journal: Journal,
        interruption: TaskInterruption,
        log: TaskLog,
        *,
        concurrency: int,
        fault: FaultPlan | None = None,
        watch: DependencyWatch | None = None,
    ) -> None:
        self._fault = fault if fault is not None else FaultPlan()
        self._watch = watch
        self._toolbox = toolbox
        self._journal = journal
        self._interruption = interruption
        self._log = log
        self._concurrency = max(1, concurrency)

    async def run(self, calls: tuple[PlannedCall, ...], turn_text: str = "") -> BatchOutcome:
        results: dict[int, FunctionResult] = {}
        due: list[tuple[int, PlannedCall, ToolBinding]] = []
        waiting: list[int] = []
        to_propose: list[tuple[PlannedCall, ToolBinding]] = []
        for index, planned in enumerate(calls):
            if planned.result is not None:
                results[index] = planned.result
                continue
            if planned.awaiting_at is not None:
                waiting.append(planned.awaiting_at)
                continue
            binding = self._toolbox.binding_for(planned.call.name)
            if binding is None:
                offered = frozenset(spec.name for spec in self._toolbox.functions)
                unknown = unknown_function_result(planned.call.name, offered)
                results[index] = _function_result(planned, unknown)
                continue
            if binding.needs_approval and not planned.approved and planned.resend is None:
                to_propose.append((planned, binding))
                continue
            due.append((index, planned, binding))
        if len(due) == 1 or self._concurrency == 1:
            for index, planned, binding in due:
                results[index] = await self._run_alone(planned, binding)
        elif due:
            results.update(await self._run_together(due))
        called = tuple(binding.ref for _, _, binding in due)
        for planned, binding in to_propose:
            waiting.append(await self._propose(planned, binding, turn_text))
        if waiting:
            return BatchOutcome((), called, tuple(sorted(waiting)))
        ordered = tuple(results[index] for index in range(len(calls)))
        return BatchOutcome(ordered, called)

    async def _propose(self, planned: PlannedCall, binding: ToolBinding, turn_text: str) -> int:
        """Journals the call AWAITING_APPROVAL: a person decides before it is ever sent."""
        self._interruption.checkpoint()
        sequence = await self._journal.propose_call(planned.call, binding.ref, turn_text)
        self._log.info("tool call awaits approval", extra={"sequence": sequence, "tool": binding.ref})
        self._fault.after_proposed(binding.ref)
        return sequence

    async def _run_alone(self, planned: PlannedCall, binding: ToolBinding) -> FunctionResult:
        """One call: a read journaled once finished (or at its own sequence if an earlier attempt
        started it); a write journaled STARTED, sent and finished as one side effect."""
        if not binding.is_write:
            self._interruption.checkpoint()
            # Journaled STARTED before it runs: the engine counts it against max_tool_calls first, so
            # a read past the limit never reaches the server.
            reserved = await self._reserve(0, planned, binding)
            result = await self._send(reserved)
            sequence = reserved.sequence
        else:
            with self._interruption.side_effect():
                reserved = await self._reserve(0, planned, binding)
                result = await self._send(reserved)
                sequence = reserved.sequence
        self._logged(planned, binding, sequence, result)
        return _function_result(planned, result)

    async def _run_together(
        self, due: list[tuple[int, PlannedCall, ToolBinding]]
    ) -> dict[int, FunctionResult]:
        writes = any(binding.is_write for _, _, binding in due)
        # With writes, journaling them STARTED begins the side effect: from then on they are all sent.
        with self._interruption.side_effect() if writes else contextlib.nullcontext():
            if not writes:
                self._interruption.checkpoint()
            reserved = [await self._reserve(index, planned, binding) for index, planned, binding in due]
            gate = asyncio.Semaphore(self._concurrency)

            async def run(step: _Reserved) -> dict[str, Any]:
                async with gate:
                    return await self._send(step)

            # Every call runs to its end before the batch reports a failure: a write in flight is
            # never abandoned because a neighbour failed.
            outcomes = await asyncio.gather(*(run(step) for step in reserved), return_exceptions=True)
        failure = next((outcome for outcome in outcomes if isinstance(outcome, BaseException)), None)
        if failure is not None:
            raise failure
        results: dict[int, FunctionResult] = {}
        for step, outcome in zip(reserved, outcomes, strict=True):
            assert not isinstance(outcome, BaseException)
            self._logged(step.planned, step.binding, step.sequence, outcome, batch=len(reserved))
            results[step.index] = _function_result(step.planned, outcome)
        return results

    async def _reserve(self, index: int, planned: PlannedCall, binding: ToolBinding) -> _Reserved:
        """Takes the call's journal sequence: its own from an earlier attempt, or the next one now."""
        if planned.resend is not None:
            return _Reserved(index, planned, binding, planned.resend.sequence, planned.resend.idempotency_key)
        if binding.is_write:
            sequence, key = await self._started(lambda: self._journal.start_write(planned.call, binding.ref))
            if binding.keyed and not key:
                self._log.warning(
                    "the engine gave no idempotency key for a keyed write", extra={"tool": binding.ref}
                )
            return _Reserved(index, planned, binding, sequence, key)
        sequence = await self._started(lambda: self._journal.start_read(planned.call, binding.ref))
        return _Reserved(index, planned, binding, sequence, "")

    async def _started(self, start: Callable[[], Awaitable[Started]]) -> Started:
        """A STARTED step, asked again while the engine holds it back for a server that is down and
        this task is its probe (the engine parks the task otherwise)."""
        return await (self._watch.call(start) if self._watch is not None else start())

    async def _send(self, step: _Reserved) -> dict[str, Any]:
        """Calls the tool (a keyed write with its key) and journals the outcome at the call's sequence."""
        binding = step.binding
        key = step.idempotency_key if binding.is_write and binding.keyed and step.idempotency_key else None
        result = await self._toolbox.call(binding, step.planned.call.args, key)
        if binding.is_write:
            await self._journal.finish_write(step.sequence, binding.ref, result)
            self._fault.boundary("write-returned")
        else:
            await self._journal.finish_read(step.sequence, binding.ref, result)
            self._fault.boundary("read-returned")
        return result

    def _logged(
        self,
        planned: PlannedCall,
        binding: ToolBinding,
        sequence: int,
        result: dict[str, Any],
        batch: int = 1,
    ) -> None:
        self._log.info(
            "tool call",
            extra={
                "sequence": sequence,
                "tool": binding.ref,
                "write": binding.is_write,
                "resent": planned.resend is not None,
                "approved": planned.approved,
                "is_error": bool(result.get("isError")),
                "batch": batch,
            },
        )


def _function_result(planned: PlannedCall, result: dict[str, Any]) -> FunctionResult:
    return FunctionResult(planned.call.id, planned.call.name, result, bool(result.get("isError")))
