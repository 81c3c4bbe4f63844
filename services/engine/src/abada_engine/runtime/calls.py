"""Call activities (`type: call`): a token that starts a child instance and waits for it to end.

Semantics follow Camunda 8's call activity. The child starts in the transaction in which the parent's
token reaches the call node, and when the child completes the parent's token moves on in the
transaction that ends the child: a crash in between can neither lose nor duplicate a child. A child
that ends otherwise (cancelled on its own) raises an incident at the parent's call node; cancelling
the parent cancels its children (`tokens.withdraw_tokens`).

Every writer of token moves calls `follow_calls` with the moves it wrote, in the same transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.ids import new_id
from abada_engine.runtime.flow.navigator import (
    HistoryEntry,
    IncidentToRaise,
    advance,
    leave_node,
)
from abada_engine.runtime.flow.tokens import (
    advance_move,
    history_record,
    move_in_locked_instance,
    start_move,
    write_history,
)
from abada_engine.runtime.held import raise_recorded_incident
from abada_engine.runtime.incident_types import CALLED_INSTANCE_ENDED
from abada_engine.store import calls as call_store
from abada_engine.store import tasks as task_store
from abada_engine.store.calls import CalledInstance
from abada_engine.store.moves import (
    NewInstance,
    NewTask,
    StartToWrite,
    TokenMove,
    start_instances,
)
from abada_engine.store.states import TaskKind, TaskState


def creates_call(move: TokenMove) -> bool:
    """Whether writing `move` starts a child: then it is written in a transaction with `follow_calls`."""
    return bool(_calls_of(move))


def _calls_of(move: TokenMove) -> list[NewTask]:
    tasks = [move.new_task, *(branch.new_task for branch in move.branches)]
    return [task for task in tasks if task is not None and task.kind is TaskKind.CALL]


async def follow_calls(conn: AsyncConnection, catalog: DefinitionCatalog, moves: Sequence[TokenMove]) -> None:
    """After `moves` were written in `conn`'s transaction: start a child for each call task they
    created, and move on the parent of each called instance they completed."""
    for move in moves:
        for task in _calls_of(move):
            await _start_child(conn, catalog, move.instance_id, task)
    completed = [move.instance_id for move in moves if move.completed]
    if completed:
        for child in await call_store.called_among(conn, completed):
            await _child_ended(conn, catalog, child)


async def _start_child(
    conn: AsyncConnection, catalog: DefinitionCatalog, parent_id: uuid.UUID, task: NewTask
) -> None:
    payload = task.payload
    definition = await catalog.find(payload["process_id"], payload["version"])
    variables: dict[str, Any] = payload["variables"]
    business_key = payload["business_key"]
    if business_key is None:
        business_key = await call_store.business_key_of(conn, parent_id)
    child_id = new_id()
    process = definition.process
    moved = advance(process, variables, process.start)
    started = HistoryEntry(
        "INSTANCE_STARTED",
        None,
        {
            "definition_id": str(definition.id),
            "version": definition.version,
            "variables": variables,
            "parent_instance_id": str(parent_id),
        },
    )
    instance = NewInstance(
        child_id, definition.id, definition.process_id, definition.version, variables, business_key
    )
    first_move = start_move(child_id, moved, [started])
    await start_instances(conn, [StartToWrite(instance, first_move)])
    await call_store.link_to_parent(conn, child_id, parent_id, task.id)
    entry = HistoryEntry(
        "CALL_STARTED",
        task.node_id,
        {
            "child_instance_id": str(child_id),
            "process_id": definition.process_id,
            "version": definition.version,
        },
    )
    await write_history(conn, [history_record(parent_id, entry, task.id)])
    # The child may call in turn, or end at once (its parent then moves on here).
    await follow_calls(conn, catalog, [first_move])


async def _child_ended(conn: AsyncConnection, catalog: DefinitionCatalog, child: CalledInstance) -> None:
    """The child completed: its call task finishes and the parent's token moves on, with the child's
    variables under `result_variable` (or merged at the top level without one)."""
    call = await task_store.lock_task_and_instance(conn, child.parent_task_id)
    if call is None or call.state != TaskState.WAITING:
        return  # the parent moved on without it (cancelled, or an operator moved the token)
    definition = await catalog.get(call.definition_id)
    node = definition.process.node(call.node_id)
    written = {node.result_variable: child.variables} if node.result_variable else dict(child.variables)
    await task_store.mark_task_completed(conn, call.id)
    finished = HistoryEntry(
        "CALL_COMPLETED", node.id, {"child_instance_id": str(child.id), "process_id": child.process_id}
    )

    async def decide(tokens_elsewhere: int | None) -> TokenMove:
        _, leaving, moved = leave_node(definition.process, node, call.variables, written, tokens_elsewhere)
        return advance_move(
            instance_id=call.instance_id,
            advance=moved,
            variables=written,
            preceding=[finished, *leaving],
            preceding_task_id=call.id,
        )

    move = await move_in_locked_instance(conn, call.instance_id, call.id, decide)
    await follow_calls(conn, catalog, [move])


async def answer_parent_of_canceled(conn: AsyncConnection, child_id: uuid.UUID) -> None:
    """A called instance was cancelled on its own: its parent's call cannot complete, so an incident
    holds the parent's token at the call node (RETRY enters the node again: a new child)."""
    called = await call_store.called_among(conn, [child_id])
    if not called:
        return
    child = called[0]
    call = await task_store.lock_task_and_instance(conn, child.parent_task_id)
    if call is None or call.state != TaskState.WAITING:
        return  # the parent is cancelling it, or moved on
    await call_store.cancel_call_task(conn, call.id)
    message = (
        f"the called instance {child.id} ({child.process_id} v{child.version}) ended {child.state.lower()}"
    )
    details = {
        "child_instance_id": str(child.id),
        "process_id": child.process_id,
        "version": child.version,
        "state": child.state,
    }
    ended = IncidentToRaise(call.node_id, CALLED_INSTANCE_ENDED, message, details)
    # The call's task is cancelled, so the incident names none; the history still says which.
    await raise_recorded_incident(conn, call.instance_id, ended, history_task_id=call.id)


__all__ = ["answer_parent_of_canceled", "creates_call", "follow_calls"]
