"""Finishing an attempt: `Complete` under the output contract, and `Fail` with retries.

Both first prove the caller holds the live lease, and a refusal changes nothing. `Complete` reads,
decides, and writes everything in one statement that re-checks the lease itself (shared by the
Completes that arrive together: a group commit); `Fail` runs in one transaction holding the task's
row lock.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.group_commit import GroupCommit
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import Node, Process
from abada_engine.errors import Category, EngineError, invalid
from abada_engine.runtime.background.handed_out import HandedOut, LeaseHeld
from abada_engine.runtime.calls import creates_call, follow_calls
from abada_engine.runtime.dependencies import (
    dependency_key,
    next_probe_delay,
    note_outage_or_hold,
)
from abada_engine.runtime.flow.contract import (
    Decision,
    Verdict,
    check_written_variables,
    judge,
    judging_can_take_long,
)
from abada_engine.runtime.flow.items import end_fan_out_if_done, end_item, item_end, item_result
from abada_engine.runtime.flow.navigator import (
    Advance,
    HistoryEntry,
    IncidentToRaise,
    JoinNeedsTokens,
    advance,
    evaluates_conditions,
    leave_node,
)
from abada_engine.runtime.flow.tokens import (
    LeaseGuard,
    advance_move,
    applied_advance,
    history_record,
    move_through_join,
    write_history,
)
from abada_engine.runtime.held import hold_for_a_person
from abada_engine.runtime.incident_types import FAILED_TASK, reserved_for_the_engine
from abada_engine.runtime.leases import hash_token, hold_lease
from abada_engine.runtime.offload import run_cpu_check, run_cpu_work
from abada_engine.store import tasks as task_store
from abada_engine.store.fan_outs import finish_items, open_items
from abada_engine.store.hand_written import HotPath
from abada_engine.store.moves import TokenMove, move_tokens
from abada_engine.store.states import TaskState

MAX_BACKOFF_MS = 600_000
# Keyword evaluations an output check may take on the event loop before it moves to the executor.
JUDGED_INLINE_STEPS = 2_000


@dataclass(frozen=True)
class AttemptMetadata:
    model: str = ""
    provider: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    tools_used: tuple[str, ...] = ()
    duration_ms: int = 0
    prompt_hash: str = ""
    confidence: float | None = None
    model_calls: int = 0
    tool_calls: int = 0
    # How long the worker waited for model quota (the engine's and the provider's), in this attempt.
    quota_wait_ms: int = 0
    # Set by the engine, never taken from the worker: the profile's prices times the task's tokens.
    cost_usd: float = 0.0
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        # Every field but tools_used is a plain value: read directly (`asdict` deep-copies each one,
        # a cost every Complete paid).
        data = {name: getattr(self, name) for name in _METADATA_FIELDS}
        data["tools_used"] = list(self.tools_used)
        return data


_METADATA_FIELDS = tuple(field.name for field in dataclasses.fields(AttemptMetadata))


@dataclass(frozen=True)
class CompleteResult:
    verdict: Verdict
    routed: bool
    next_node_id: str
    incident_id: uuid.UUID | None
    reason: str


@dataclass(frozen=True)
class FailResult:
    will_retry: bool
    retry_at: datetime | None
    incident_id: uuid.UUID | None


# How many times a Complete reads the instance again when it moved between the read and the write.
_CAREFUL_TRIES = 5


class Completions:
    def __init__(
        self,
        engine: AsyncEngine,
        catalog: DefinitionCatalog,
        handed_out: HandedOut | None = None,
        hot: HotPath | None = None,
    ) -> None:
        self._engine = engine
        self._hot = hot if hot is not None else HotPath(engine)
        self._catalog = catalog
        self._handed_out = handed_out if handed_out is not None else HandedOut()
        # Completes that arrive while the previous batch is in the database move their tokens together
        # next, in one statement (each under its own lease guard, answered on its own).
        self._moves = GroupCommit(self._move_many, each_alone_on_failure=True)
        # The ends of `for_each` items that arrive together go in one statement as well.
        self._item_ends = GroupCommit(self._hot.batch_statement(finish_items), each_alone_on_failure=True)
        # The fan-outs whose end this replica is deciding, with when each decision began.
        self._deciding: dict[uuid.UUID, float] = {}
        self._rng = random.Random()

    async def complete(
        self,
        task_id: uuid.UUID,
        worker_id: str,
        lease_token: str,
        variables: dict[str, Any],
        metadata: AttemptMetadata,
        invalid_output_reason: str = "",
        *,
        large_output: bool = False,
    ) -> CompleteResult:
        """Judge the output and move the token, in one statement that re-checks the lease itself.

        The task's instance as it was when this replica handed the task out is usually remembered, so
        no read is needed; the write is guarded by the instance row's version, and anything that
        changed it (or a Complete on another replica's lease) takes the careful path: read, then write.
        A `large_output` is judged on the bounded executor straight away, without an inline attempt.
        """
        # Remembered only for the worker that holds this very token: nobody else's Complete gets as
        # far as validating its output (a cost) on memory, nor takes the holder's fast path away.
        snapshot = self._handed_out.take_lease(task_id, worker_id, hash_token(lease_token))
        if snapshot is not None:
            try:
                done = await self._judge_and_move(
                    snapshot, worker_id, lease_token, variables, metadata, invalid_output_reason, large_output
                )
            except EngineError:
                done = None  # say nothing before the lease is proven: the careful path decides
            if done is not None:
                return done
        # Read, then write; again while the instance moved in between (the other branches of a
        # parallel move it too), a few times: each miss means another token moved on meanwhile.
        for _ in range(_CAREFUL_TRIES):
            async with self._hot.connect() as conn:
                held = await hold_lease(conn, task_id, worker_id, lease_token, lock=False)
            done = await self._judge_and_move(
                held, worker_id, lease_token, variables, metadata, invalid_output_reason, large_output
            )
            if done is not None:
                return done
        # The lease or the instance changed between the read and the write; say how.
        async with self._hot.connect() as conn:
            await hold_lease(conn, task_id, worker_id, lease_token, lock=False)
        raise EngineError(
            Category.ABORTED, ErrorReason.CONCURRENT_CHANGE, f"task {task_id} changed; try again"
        )

    async def _move_many(self, moves: Sequence[TokenMove]) -> list[bool]:
        """One batch of the Completes' group commit. A second move of an instance in the batch is not
        sent (both would pass the instance's version guard in one statement): it comes back refused
        and its Complete takes the careful path, which reads the instance again."""
        first_of: dict[uuid.UUID, int] = {}
        for index, move in enumerate(moves):
            first_of.setdefault(move.instance_id, index)
        sent = list(first_of.values())
        async with self._hot.connect() as conn:
            written = await move_tokens(conn, [moves[index] for index in sent])
        applied = [False] * len(moves)
        for index, ok in zip(sent, written, strict=True):
            applied[index] = ok
        return applied

    async def _decide_fan_out(
        self, process: Process, node: Node, instance_id: uuid.UUID, fan_out_id: uuid.UUID, ended_at: float
    ) -> None:
        """Decide the fan-out's end under its lock, unless a decision this replica began after this item's
        end was written is under way: that one counts this item ended (if it fails, `FanOutEnds` decides).
        So the last round's ends, often answered together, do not queue on the lock one by one."""
        if self._deciding.get(fan_out_id, -1.0) > ended_at:
            return
        began = time.monotonic()
        self._deciding[fan_out_id] = began
        try:
            async with self._engine.begin() as conn:
                await end_fan_out_if_done(conn, self._catalog, process, node, instance_id, fan_out_id)
        finally:
            if self._deciding.get(fan_out_id) == began:
                del self._deciding[fan_out_id]

    async def _no_item_open(self, fan_out_id: uuid.UUID) -> bool:
        """Whether no item of the fan-out is open (a read, no lock): only then may this end be the
        fan-out's, decided under its lock."""
        async with self._hot.connect() as conn:
            return await open_items(conn, fan_out_id) == 0

    async def _judge_and_move(
        self,
        held: LeaseHeld,
        worker_id: str,
        lease_token: str,
        variables: dict[str, Any],
        metadata: AttemptMetadata,
        invalid_output_reason: str,
        large_output: bool,
    ) -> CompleteResult | None:
        task_id = held.task_id
        definition = await self._catalog.get(held.definition_id)
        node = definition.process.node(held.node_id)
        check_written_variables(node, variables)
        profile = definition.process.model_profile(node.id)
        if profile is not None:
            cost = profile.price.cost_usd(metadata.input_tokens, metadata.output_tokens)
            metadata = dataclasses.replace(metadata, cost_usd=round(cost, 9))
        # Schema validation is CPU work on worker data, under a budget: a small check inline, a large
        # one in the bounded executor (`offload`).
        decision = await run_cpu_check(
            judging_can_take_long(node),
            0 if large_output else JUDGED_INLINE_STEPS,
            judge,
            node,
            variables,
            metadata.confidence,
            invalid_output_reason,
        )
        completed = HistoryEntry(
            "TASK_COMPLETED",
            node.id,
            {
                "attempt": held.attempt,
                "worker_id": worker_id,
                "metadata": metadata.to_json(),
                "verdict": decision.verdict.value,
            },
        )

        if node.fans_out and (decision.verdict is Verdict.ACCEPTED or node.skips_failed_items):
            return await self._end_item(
                held, definition.process, node, worker_id, lease_token, variables, decision, completed
            )

        async def decide(tokens_elsewhere: int | None) -> TokenMove:
            preceding = [completed]
            written: dict[str, Any] | None = None
            if decision.verdict is Verdict.ACCEPTED:
                assert node.next is not None
                _, leaving, moved = await run_cpu_work(
                    evaluates_conditions(definition.process, node.next),
                    leave_node,
                    definition.process,
                    node,
                    held.variables,
                    variables,
                    tokens_elsewhere,
                )
                # Only what this task wrote: a branch moving beside it keeps what it wrote meanwhile.
                written = variables
                preceding += leaving
            else:
                rejected = {
                    "verdict": decision.verdict.value,
                    "reason": decision.reason,
                    "output": variables,
                    "confidence": metadata.confidence,
                }
                preceding.append(HistoryEntry("OUTPUT_REJECTED", node.id, rejected))
                if decision.route is not None:
                    moved = await run_cpu_work(
                        evaluates_conditions(definition.process, decision.route),
                        functools.partial(advance, tokens_elsewhere=tokens_elsewhere),
                        definition.process,
                        held.variables,
                        decision.route,
                        {"rejected": rejected},
                    )
                else:
                    # No route: an incident holds the instance at this node; nothing of the output is kept.
                    moved = Advance(
                        current_node_id=node.id,
                        incident=IncidentToRaise(
                            node.id,
                            decision.incident_type,
                            decision.reason,
                            {"output": variables, "confidence": metadata.confidence},
                            task_id=task_id,
                        ),
                    )
            return advance_move(
                instance_id=held.instance_id,
                advance=moved,
                variables=written,
                preceding=preceding,
                preceding_task_id=task_id,
                finished_task_id=task_id,
                guard=LeaseGuard(worker_id, hash_token(lease_token), held.instance_xmin),
                # A rejected answer without a route is held, not finished: a retry re-asks the model
                # on the same journal, re-running no tool.
                finished_state=TaskState.COMPLETED
                if decision.verdict is Verdict.ACCEPTED or decision.route
                else TaskState.INCIDENT,
            )

        try:
            move: TokenMove | None = await decide(None)
        except JoinNeedsTokens:
            move = None
        if (
            move is None
            or move.branches
            or move.withdraws_other_branches
            or creates_call(move)
            or (move.completed and held.called)
        ):
            # A fork or a join: decided on the instance's live tokens, locked, in a transaction; a
            # call starts its child, or a called instance's end moves its parent, in the same one.
            async with self._engine.begin() as conn:
                move, written = await move_through_join(
                    conn, held.instance_id, task_id, held.instance_xmin, decide
                )
                if not written:
                    await conn.rollback()
                else:
                    await follow_calls(conn, self._catalog, [move])
            applied = applied_advance(move, written)
        else:
            applied = applied_advance(move, await self._moves.submit(move))
        if not applied.applied:
            return None
        routed = decision.verdict is not Verdict.ACCEPTED and decision.route is not None
        return CompleteResult(
            decision.verdict, routed, applied.current_node_id, applied.incident_id, decision.reason
        )

    async def _end_item(
        self,
        held: LeaseHeld,
        process: Process,
        node: Node,
        worker_id: str,
        lease_token: str,
        variables: dict[str, Any],
        decision: Decision,
        completed: HistoryEntry,
    ) -> CompleteResult | None:
        """An item of a `for_each` ends on its own rows, under its lease: accepted, its result is kept
        for `collect`; rejected on a node that skips failed items, it is left out (null)."""
        history = [completed]
        if decision.verdict is Verdict.ACCEPTED:
            state, result = TaskState.COMPLETED, item_result(node, variables)
        else:
            state, result = TaskState.SKIPPED, None
            history.append(
                HistoryEntry(
                    "ITEM_SKIPPED", node.id, {"reason": decision.reason, "verdict": decision.verdict.value}
                )
            )
        # One statement on the hot path; only an item of the last round then asks whether the fan-out is
        # over (a replica dying in between leaves that to `FanOutEnds`).
        finished = await self._item_ends.submit(
            item_end(
                held.instance_id,
                held.task_id,
                state,
                result,
                history,
                guard_worker=worker_id,
                guard_hash=hash_token(lease_token),
            )
        )
        ended_at = time.monotonic()
        if finished is None:
            return None
        if finished.may_be_last and await self._no_item_open(finished.fan_out_id):
            await self._decide_fan_out(process, node, held.instance_id, finished.fan_out_id, ended_at)
        return CompleteResult(decision.verdict, False, node.id, None, decision.reason)

    async def fail(
        self,
        task_id: uuid.UUID,
        worker_id: str,
        lease_token: str,
        error_code: str,
        error_message: str,
        error_details: dict[str, Any],
        no_retry: bool,
        *,
        transient: bool = False,
        retry_after_ms: int = 0,
    ) -> FailResult:
        if len(error_message) > 10_000:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "error_message", "is longer than 10000 characters")
        if transient and no_retry:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                "transient",
                "a failure is temporary or beyond retrying, not both",
            )
        if retry_after_ms < 0:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "retry_after_ms", "cannot be negative")
        if reserved_for_the_engine(error_code):
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                "error_code",
                f"{error_code!r} is an incident type only the engine raises; name the failure otherwise",
            )
        async with self._engine.begin() as conn:
            held = await hold_lease(conn, task_id, worker_id, lease_token)
            definition = await self._catalog.get(held.definition_id)
            node = definition.process.node(held.node_id)
            error = {
                "code": error_code or "FAILED",
                "message": error_message,
                "details": error_details,
                "attempt": held.attempt,
                "worker_id": worker_id,
            }
            if transient:
                return await self._wait_out(conn, held, node, error, retry_after_ms)
            records_entry = HistoryEntry("TASK_FAILED", node.id, error)
            records = [history_record(held.instance_id, records_entry, task_id)]
            if not no_retry and held.retries_left > 0:
                failures = node.retries - held.retries_left + 1
                backoff_ms = min(node.retry_backoff_ms * 2 ** (failures - 1), MAX_BACKOFF_MS)
                retry_at = await task_store.release_for_retry(conn, task_id, backoff_ms, error)
                await write_history(conn, records)
                return FailResult(True, retry_at, None)
            if node.fans_out and node.skips_failed_items:
                reason = error_message or error_code or "the task failed"
                skipped = HistoryEntry("ITEM_SKIPPED", node.id, {"reason": reason, "error": error})
                end = item_end(
                    held.instance_id,
                    task_id,
                    TaskState.SKIPPED,
                    None,
                    [records_entry, skipped],
                    from_state=TaskState.LEASED,
                )
                await end_item(conn, self._catalog, definition.process, node, held.instance_id, end)
                return FailResult(False, None, None)
            incident_type = error_code if no_retry and error_code else FAILED_TASK
            message = error_message or "the task failed"
            if not no_retry:
                message = f"no retries left: {message}"
            failed = IncidentToRaise(node.id, incident_type, message, error, task_id)
            incident_id = await hold_for_a_person(
                conn, held.instance_id, failed, last_error=error, preceding=records
            )
            return FailResult(False, None, incident_id)

    async def _wait_out(
        self, conn: AsyncConnection, held: LeaseHeld, node: Node, error: dict[str, Any], retry_after_ms: int
    ) -> FailResult:
        """A temporary failure costs time, not a retry: the task is offered again after a backoff
        (exponential with full jitter, 1 s doubling to 60 s, at least `retry_after_ms`) until the
        node's outage budget runs out; then a DEPENDENCY_UNAVAILABLE incident holds it."""
        details = error["details"] if isinstance(error["details"], dict) else {}
        key = dependency_key("service", str(details.get("dependency") or node.topic or node.id))
        streak, incident_id = await note_outage_or_hold(
            conn, held.task_id, held.instance_id, node, key, str(error["message"])
        )
        if incident_id is not None:
            return FailResult(False, None, incident_id)
        delay = next_probe_delay(streak.outage_waits - 1, retry_after_ms / 1000, self._rng)
        retry_at = await task_store.wait_out(conn, held.task_id, int(delay * 1000), error)
        entry = HistoryEntry("TASK_WAITING", node.id, {**error, "retry_at": retry_at.isoformat()})
        await write_history(conn, [history_record(held.instance_id, entry, held.task_id)])
        return FailResult(True, retry_at, None)
