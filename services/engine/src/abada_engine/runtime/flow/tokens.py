"""Persisting a token move (an `Advance`) inside the caller's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.ids import new_id
from abada_engine.runtime.flow.navigator import Advance, HistoryEntry, JoinNeedsTokens, TaskToCreate
from abada_engine.store import approvals as approval_store
from abada_engine.store import calls as call_store
from abada_engine.store import fan_outs as fan_out_store
from abada_engine.store import history as history_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import instances as instance_store
from abada_engine.store import tasks as task_store
from abada_engine.store import tokens as token_store
from abada_engine.store.hand_written import Executor
from abada_engine.store.history import HistoryRecord
from abada_engine.store.incidents import BRANCH_WITHDRAWN, INSTANCE_CANCELED
from abada_engine.store.moves import (
    LeaseGuard,
    NewFanOut,
    NewIncident,
    NewTask,
    NewTimer,
    TokenMove,
    move_token,
)
from abada_engine.store.states import TaskKind, TaskState

__all__ = [
    "AppliedAdvance",
    "LeaseGuard",
    "advance_move",
    "applied_advance",
    "apply_move",
    "cancel_called",
    "history_record",
    "move_in_locked_instance",
    "move_through_join",
    "needs_transaction",
    "start_move",
    "withdraw_tokens",
    "write_history",
]


@dataclass(frozen=True)
class AppliedAdvance:
    task_id: uuid.UUID | None
    incident_id: uuid.UUID | None
    current_node_id: str
    completed: bool
    applied: bool = True


def history_record(
    instance_id: uuid.UUID, entry: HistoryEntry, task_id: uuid.UUID | None = None
) -> HistoryRecord:
    return HistoryRecord(instance_id, entry.type, entry.node_id, task_id, entry.data)


async def write_history(conn: AsyncConnection, records: list[HistoryRecord]) -> None:
    await history_store.append(conn, records)


async def apply_move(conn: Executor, move: TokenMove) -> AppliedAdvance:
    """Write a move (`advance_move`) in one statement: the next task or incident, the instance's new
    position and variables, and the history, in order; with a guard, only while that lease is live,
    and otherwise nothing at all is written (`applied` is False)."""
    return applied_advance(move, await move_token(conn, move))


def advance_move(
    *,
    instance_id: uuid.UUID,
    advance: Advance,
    variables: dict[str, Any] | None,
    preceding: list[HistoryEntry],
    preceding_task_id: uuid.UUID | None = None,
    finished_task_id: uuid.UUID | None = None,
    guard: LeaseGuard | None = None,
    finished_state: TaskState = TaskState.COMPLETED,
    only_if_open: bool = False,
) -> TokenMove:
    """What `advance` decided, as one move to write (`apply_move`, or a group commit of them).

    `variables` is the instance's new variable map, or None when it did not change;
    `finished_task_id` is a task this move ends (in `finished_state`: COMPLETED, or INCIDENT when an
    incident holds it for a retry), with `guard` only while that lease is live, and with
    `only_if_open` only while that task is still open (a due time firing after the task moved on).
    """
    move = _token_move(instance_id, advance, variables, preceding, preceding_task_id)
    return replace(
        move,
        finished_task_id=finished_task_id,
        finished_state=finished_state,
        guard=guard,
        only_if_open=only_if_open,
    )


def start_move(instance_id: uuid.UUID, advance: Advance, preceding: list[HistoryEntry]) -> TokenMove:
    """The first move of a new instance: where its first `advance` left it, with the history before."""
    return _token_move(instance_id, advance, None, preceding, None)


def _token_move(
    instance_id: uuid.UUID,
    advance: Advance,
    variables: dict[str, Any] | None,
    preceding: list[HistoryEntry],
    preceding_task_id: uuid.UUID | None,
) -> TokenMove:
    records = [history_record(instance_id, e, preceding_task_id) for e in preceding]
    records += [history_record(instance_id, e) for e in advance.history]
    new_task = None
    if advance.task is not None:
        task = advance.task
        timers = tuple(NewTimer(t.kind, t.delay_seconds, t.at) for t in task.timers)
        new_task = NewTask(new_id(), task.node.id, task.kind, task.topic, task.payload, task.retries, timers)
        records.append(history_record(instance_id, _created_entry(task), new_task.id))
    new_fan_out = None
    if advance.fan_out is not None:
        fan = advance.fan_out
        new_fan_out = NewFanOut(
            new_id(),
            fan.node.id,
            fan.kind,
            fan.topic,
            fan.retries,
            fan.node.concurrency,
            tuple(new_id() for _ in fan.payloads),
            tuple(fan.payloads),
        )
        # One line for all the items: a fan-out of thousands writes no line per item it offers.
        started = HistoryEntry(
            "FAN_OUT_STARTED",
            fan.node.id,
            {
                "fan_out_id": str(new_fan_out.id),
                "items": len(fan.payloads),
                "max_concurrency": fan.node.concurrency,
                "topic": fan.topic,
            },
        )
        records.append(history_record(instance_id, started))
    if advance.written:
        variables = {**(variables or {}), **advance.written}
    new_incident = None
    if advance.incident is not None:
        incident = advance.incident
        new_incident = NewIncident(
            new_id(),
            incident.node_id,
            incident.type,
            incident.message,
            incident.details,
            incident.task_id,
        )
        records.append(history_record(instance_id, incident.raised(new_incident.id), incident.task_id))
    # Each branch rests where its own walk stopped; the instance's current node stays the fork's.
    branches = tuple(
        replace(_token_move(instance_id, branch, None, [], None), current_node_id=advance.current_node_id)
        for branch in advance.forked
    )
    return TokenMove(
        instance_id=instance_id,
        current_node_id=advance.current_node_id,
        completed=advance.completed,
        variables=variables,
        history=records,
        new_task=new_task,
        new_incident=new_incident,
        branches=branches,
        withdraws_other_branches=advance.withdraw_other_branches,
        fan_out=new_fan_out,
    )


def needs_transaction(advance: Advance) -> bool:
    """Whether a move writes more than its own statement: branches of a fork, or the withdrawal of the
    branches a join on `any` passed by."""
    return bool(advance.forked) or advance.withdraw_other_branches


async def withdraw_tokens(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    why: str,
    *,
    but: uuid.UUID | None = None,
    branches: bool = False,
) -> None:
    """End the instance's live tokens, in the caller's transaction: its open tasks are withdrawn (their
    leases refused from now on), its incidents closed, its pending approvals cancelled. A cancel ends
    them all; a join on `any` (`branches`) all but the task of the branch that passed it (`but`)."""
    resolution = BRANCH_WITHDRAWN if branches else INSTANCE_CANCELED
    await task_store.cancel_open_tasks(conn, instance_id, but)
    if not branches:
        await fan_out_store.cancel_of_instance(conn, instance_id)
    await incident_store.close_all_of_instance(conn, instance_id, resolution)
    await approval_store.cancel_pending_of_instance(conn, instance_id, why)
    await cancel_called(conn, instance_id, why, but_task=but)


async def cancel_called(
    conn: AsyncConnection,
    parent_id: uuid.UUID,
    why: str,
    *,
    but_task: uuid.UUID | None = None,
    only_task: uuid.UUID | None = None,
) -> None:
    """Cancel the instances the parent's call activities started, and theirs, as a cancel ends an
    instance (their tasks withdrawn, incidents closed, approvals cancelled): all of them, all but the
    child of `but_task`, or only the child of `only_task` (a token moved away from its call)."""
    for child_id in await call_store.active_subtree(conn, parent_id, but_task=but_task, only_task=only_task):
        await task_store.cancel_open_tasks(conn, child_id)
        await incident_store.close_all_of_instance(conn, child_id, INSTANCE_CANCELED)
        await approval_store.cancel_pending_of_instance(conn, child_id, why)
        await instance_store.mark_canceled(conn, child_id)
        entry = HistoryEntry("INSTANCE_CANCELED", None, {"reason": why, "by_parent": str(parent_id)})
        await write_history(conn, [history_record(child_id, entry)])


async def move_through_join(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    leaving_task_id: uuid.UUID | None,
    decided_on_xmin: str | None,
    decide: Callable[[int], Awaitable[TokenMove]],
    *,
    instance_locked: bool = False,
) -> tuple[TokenMove, bool]:
    """Move a token whose walk forks or reaches a join, in the caller's transaction: the instance's
    live tokens are locked and counted, `decide` builds the move on that count, and a join on `any`
    withdraws the other branches before the move is written. With `decided_on_xmin`, the instance
    must still be at that version (the caller read its variables there), else nothing is written.
    Answers the move and whether it was written; when it was not, the caller rolls back. A caller
    that locked the instance row already (`instance_locked`) has the order of locks the other way
    round: only the instance is locked again."""
    locked = await token_store.lock_tokens(conn, instance_id, leaving_task_id, lock_tasks=not instance_locked)
    if locked is None or (decided_on_xmin is not None and locked.instance_xmin != decided_on_xmin):
        return await decide(0), False
    move = await decide(locked.elsewhere)
    if move.withdraws_other_branches:
        await withdraw_tokens(
            conn, instance_id, "a join on any let another branch through", but=leaving_task_id
        )
    return move, await move_token(conn, move)


async def move_in_locked_instance(
    conn: AsyncConnection,
    instance_id: uuid.UUID,
    leaving_task_id: uuid.UUID | None,
    decide: Callable[[int | None], Awaitable[TokenMove]],
    *,
    decide_at_join: Callable[[int], Awaitable[TokenMove]] | None = None,
) -> TokenMove:
    """Move a token of an instance the caller has locked, in its transaction: at once when the walk
    needs no count of the live tokens, else through the join (`move_through_join`), decided there by
    `decide_at_join` (`decide` unless given). Answers the move written."""
    try:
        move: TokenMove | None = await decide(None)
    except JoinNeedsTokens:
        move = None
    if move is None or move.withdraws_other_branches:
        move, _ = await move_through_join(
            conn, instance_id, leaving_task_id, None, decide_at_join or decide, instance_locked=True
        )
    else:
        await move_token(conn, move)
    return move


def _created_entry(task: TaskToCreate) -> HistoryEntry:
    """The history line of a new task: what it waits for, and until when."""
    data: dict[str, Any] = {"topic": task.topic}
    if task.kind is TaskKind.USER:
        return HistoryEntry("USER_TASK_CREATED", task.node.id, data)
    due = {t.kind.lower(): t.at.isoformat() if t.at else f"in {t.delay_seconds:g}s" for t in task.timers}
    if task.kind is TaskKind.TIMER:
        return HistoryEntry("TIMER_STARTED", task.node.id, due)
    if task.kind is TaskKind.RECEIVE:
        return HistoryEntry("MESSAGE_AWAITED", task.node.id, {**task.payload, **due})
    if task.kind is TaskKind.CALL:
        payload = task.payload
        return HistoryEntry(
            "CALL_ACTIVATED",
            task.node.id,
            {"process_id": payload["process_id"], "version": payload["version"]},
        )
    return HistoryEntry("TASK_CREATED", task.node.id, {**data, **due})


def applied_advance(move: TokenMove, applied: bool) -> AppliedAdvance:
    """What a written (or, `applied` False, refused) move did."""
    return AppliedAdvance(
        move.new_task.id if move.new_task else None,
        move.new_incident.id if move.new_incident else None,
        move.current_node_id,
        move.completed,
        applied,
    )
