"""Waiting on the world: due times that fire (timers, receive timeouts, deadlines) and messages.

A due time is a row (`store/timers.py`) set in the same statement as the task it belongs to. Any
replica claims the passed ones with SKIP LOCKED and moves their tokens in the claiming transaction,
so each fires once across replicas and restarts: a replica that dies mid-round rolls its claim back.
A due time whose task moved on meanwhile (the agent answered before its deadline) fires into nothing.

Messages follow Zeebe's semantics: a publication goes to the oldest receive waiting for its name and
correlation key; with none waiting it is buffered for its ttl and taken by the first receive that
matches within it; a `message_id` answers a re-publication within the ttl with the first one.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.definitions.catalog import Definition, DefinitionCatalog
from abada_engine.definitions.model import Node, Process
from abada_engine.ids import new_id
from abada_engine.runtime.calls import follow_calls
from abada_engine.runtime.flow.navigator import HistoryEntry, advance
from abada_engine.runtime.flow.tokens import advance_move, apply_move, history_record, write_history
from abada_engine.store import approvals as approval_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import journal_steps as step_store
from abada_engine.store import messages as message_store
from abada_engine.store import timers as timer_store
from abada_engine.store.messages import MessageRow, NewMessage, WaitingReceive
from abada_engine.store.moves import TokenMove, move_tokens
from abada_engine.store.states import (
    OPEN_TASK_STATES,
    ApprovalState,
    StepKind,
    StepState,
    TaskState,
    TimerKind,
)

_WITHDRAWN = "the node's deadline passed and withdrew the task"
# How many due times one round claims: one transaction, one statement for all their moves.
FIRE_BATCH = 200
_YIELD_EVERY = 10


@dataclass(frozen=True)
class Publication:
    """What publishing answered: the message's id, and the instance it went to (None: buffered)."""

    message_key: uuid.UUID
    correlated_instance_id: uuid.UUID | None
    # True when a message_id repeated a publication within its ttl: this answers with that one.
    duplicate: bool = False


class Waits:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog) -> None:
        self._engine = engine
        self._catalog = catalog

    async def fire_due(self, limit: int = FIRE_BATCH) -> int:
        """Fire up to `limit` passed due times; how many were claimed."""
        async with self._engine.begin() as conn:
            due = await timer_store.claim_due(conn, limit)
            moves: list[TokenMove] = []
            fired: list[tuple[timer_store.DueTimer, Definition]] = []
            moving: set[uuid.UUID] = set()  # tasks
            for index, timer in enumerate(due):
                if index % _YIELD_EVERY == _YIELD_EVERY - 1:
                    # Deciding the moves is Python on the event loop: let the calls it serves in between
                    # (a FetchAndLock, a Complete) run, rather than wait for the whole batch.
                    await asyncio.sleep(0)
                # One move per task: a second due time of the same wait (a receive's timeout and its
                # deadline together) finds the task gone once the first moved it.
                if not timer.instance_active or timer.task_state not in OPEN_TASK_STATES:
                    continue
                if timer.task_id in moving:
                    continue
                moving.add(timer.task_id)
                definition = await self._catalog.get(timer.definition_id)
                moves.append(_fired_move(definition.process, timer))
                fired.append((timer, definition))
            if moves:
                written = await _move_in_rounds(conn, moves)
                await follow_calls(
                    conn, self._catalog, [m for m, ok in zip(moves, written, strict=True) if ok]
                )
                withdrawn = [
                    (timer, definition)
                    for (timer, definition), applied in zip(fired, written, strict=True)
                    if applied and timer.kind == TimerKind.DEADLINE
                ]
                await close_withdrawn(
                    conn,
                    [
                        WithdrawnTask(t.task_id, t.instance_id, t.node_id, t.task_state, d)
                        for t, d in withdrawn
                    ],
                    _WITHDRAWN,
                    "DEADLINE_PASSED",
                    "the node's deadline withdrew the task while this write was in flight",
                )
        return len(due)

    async def next_due(self) -> tuple[float | None, float]:
        """The earliest unfired due time and the database's now (epoch seconds)."""
        async with self._engine.connect() as conn:
            return await timer_store.next_due(conn)

    async def publish(
        self,
        name: str,
        correlation_key: str,
        variables: dict[str, Any],
        ttl_seconds: float,
        message_id: str | None,
        published_by: str,
    ) -> Publication:
        """Correlate a message to the oldest matching receive, or buffer it for `ttl_seconds`."""
        async with self._engine.begin() as conn:
            if message_id:
                await message_store.hold_message_id(conn, name, message_id)
                earlier = await message_store.live_by_message_id(conn, name, message_id)
                if earlier is not None:
                    return Publication(earlier.id, earlier.correlated_instance_id, duplicate=True)
            receive = await message_store.lock_oldest_receive(conn, name, correlation_key)
            message = NewMessage(
                new_id(),
                name,
                correlation_key,
                variables,
                message_id,
                published_by,
                ttl_seconds,
                receive.instance_id if receive else None,
            )
            written = await message_store.insert_message(conn, message)
            if receive is not None:
                await self._deliver(conn, receive, written)
        if receive is None:
            # A receive created while this was buffering saw no message; look once more now that
            # the message is committed (one of the two always sees the other).
            await self.correlate_buffered()
        return Publication(message.id, message.correlated_instance_id)

    async def correlate_buffered(self, limit: int = 100) -> int:
        """Deliver buffered messages to receives that wait for them now; how many were delivered."""
        delivered = 0
        async with self._engine.begin() as conn:
            for message in await message_store.lock_matchable(conn, limit):
                receive = await message_store.lock_oldest_receive(conn, message.name, message.correlation_key)
                if receive is None:
                    continue
                await message_store.mark_correlated(conn, message.id, receive.instance_id)
                await self._deliver(conn, receive, message)
                delivered += 1
        return delivered

    async def forget_expired(self) -> int:
        """Publications past their ttl are deleted (a round of the periodic upkeep)."""
        async with self._engine.begin() as conn:
            return await message_store.delete_expired(conn)

    async def _deliver(self, conn: AsyncConnection, receive: WaitingReceive, message: MessageRow) -> None:
        definition = await self._catalog.get(receive.definition_id)
        node = definition.process.node(receive.node_id)
        written = received_variables(node, message.variables)
        new_variables = {**receive.variables, **written}
        assert node.next is not None
        history = [
            HistoryEntry(
                "MESSAGE_RECEIVED",
                node.id,
                {
                    "message": message.name,
                    "correlation_key": message.correlation_key,
                    "message_key": str(message.id),
                    "message_id": message.message_id,
                },
            ),
            *(HistoryEntry("VARIABLE_WRITTEN", node.id, {"name": k, "value": v}) for k, v in written.items()),
            HistoryEntry("NODE_COMPLETED", node.id),
        ]
        move = advance_move(
            instance_id=receive.instance_id,
            advance=advance(definition.process, new_variables, node.next),
            # Only what the message wrote: a branch moving beside this one keeps its writes.
            variables=written,
            preceding=history,
            preceding_task_id=receive.task_id,
            finished_task_id=receive.task_id,
            only_if_open=True,
        )
        if (await apply_move(conn, move)).applied:
            await follow_calls(conn, self._catalog, [move])


@dataclass(frozen=True)
class WithdrawnTask:
    """A task withdrawn from under its worker (a deadline passed, an operator moved its token), as it
    was just before: its state says what else held it."""

    task_id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    task_state: str
    definition: Definition


async def close_withdrawn(
    conn: AsyncConnection,
    withdrawn: list[WithdrawnTask],
    why: str,
    incident_resolution: str,
    write_in_flight: str,
) -> None:
    """What held withdrawn tasks for a person ends with them (pending approvals, an incident), and an
    agent's write caught in flight becomes OUTCOME_UNKNOWN; in the caller's transaction."""
    for task in withdrawn:
        if task.task_state == TaskState.AWAITING_APPROVAL:
            await approval_store.close_pending_of_task(conn, task.task_id, ApprovalState.CANCELED, why)
        if task.task_state == TaskState.INCIDENT:
            await incident_store.close_open_of_task(conn, task.task_id, incident_resolution)
    agents = [t for t in withdrawn if t.definition.process.node(t.node_id).type == "agent"]
    if agents:
        await _writes_caught_in_flight(conn, agents, write_in_flight)


async def _writes_caught_in_flight(conn: AsyncConnection, withdrawn: list[WithdrawnTask], why: str) -> None:
    """An agent task withdrawn with a write sent and no answer: the write may have happened, and
    nothing will re-send it; the step becomes OUTCOME_UNKNOWN, said in the history."""
    journals = await step_store.steps_of(conn, [task.task_id for task in withdrawn])
    records = []
    for task in withdrawn:
        writes = {b.ref for b in task.definition.bindings_for(task.node_id) if b.policy == "write"}
        for step in journals.get(task.task_id, []):
            if step.kind != StepKind.TOOL_CALL or step.state != StepState.STARTED or step.abandoned:
                continue
            if step.tool_ref not in writes:
                continue
            await step_store.mark_outcome_unknown(conn, task.task_id, step.sequence)
            entry = HistoryEntry(
                "STEP_OUTCOME_UNKNOWN",
                task.node_id,
                {"sequence": step.sequence, "attempt": step.attempt, "tool_ref": step.tool_ref, "why": why},
            )
            records.append(history_record(task.instance_id, entry, task.task_id))
    if records:
        await write_history(conn, records)


def received_variables(node: Node, variables: dict[str, Any]) -> dict[str, Any]:
    """What a message writes: all of it under `result_variable`, else each of its variables at the top."""
    if node.result_variable:
        return {node.result_variable: variables}
    return dict(variables)


_FIRED = {
    TimerKind.TIMER: ("TIMER_FIRED", TaskState.COMPLETED),
    TimerKind.RECEIVE_TIMEOUT: ("MESSAGE_TIMED_OUT", TaskState.CANCELED),
    TimerKind.DEADLINE: ("DEADLINE_PASSED", TaskState.CANCELED),
}


async def _move_in_rounds(conn: AsyncConnection, moves: list[TokenMove]) -> list[bool]:
    """Write the moves, one move per instance per statement (the statement's rule): the due times of
    two parallel branches of one instance are written one after the other, in the same transaction."""
    written = [False] * len(moves)
    pending = list(range(len(moves)))
    while pending:
        first_of: dict[uuid.UUID, int] = {}
        for index in pending:
            first_of.setdefault(moves[index].instance_id, index)
        now = list(first_of.values())
        for index, ok in zip(now, await move_tokens(conn, [moves[i] for i in now]), strict=True):
            written[index] = ok
        pending = [i for i in pending if i not in first_of.values()]
    return written


def _fired_move(process: Process, timer: timer_store.DueTimer) -> TokenMove:
    """Where a passed due time moves its token: on from a timer, to a receive's on_timeout, or (the
    task withdrawn) to a deadline's on_deadline; only if its task is still open when written."""
    node = process.node(timer.node_id)
    kind = TimerKind(timer.kind)
    entry_type, finished_state = _FIRED[kind]
    details: dict[str, Any] = {
        "kind": kind.value,
        "due_at": timer.due_at.isoformat(),
        "fired_at": timer.fired_at.isoformat(),
    }
    if kind is TimerKind.TIMER:
        target = node.next
    elif kind is TimerKind.RECEIVE_TIMEOUT:
        target = node.on_timeout
        details["timeout_seconds"] = node.timeout_seconds
    else:
        target = node.on_deadline
        details["deadline_seconds"] = node.deadline_seconds
        details["task_state"] = timer.task_state
    assert target is not None
    context = None if kind is TimerKind.TIMER else {kind.value.lower(): details}
    return advance_move(
        instance_id=timer.instance_id,
        advance=advance(process, timer.variables, target, context=context),
        variables=None,
        preceding=[HistoryEntry(entry_type, node.id, details), HistoryEntry("NODE_COMPLETED", node.id)]
        if kind is TimerKind.TIMER
        else [HistoryEntry(entry_type, node.id, details)],
        preceding_task_id=timer.task_id,
        finished_task_id=timer.task_id,
        finished_state=finished_state,
        only_if_open=True,
    )
