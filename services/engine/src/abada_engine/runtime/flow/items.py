"""Ending an item of a `for_each` node, and with the last one the fan-out: the token moves on.

An item's end writes only its own rows (its task, its result, its history line, and the next item it
offers); only an end that found no item left to offer asks, under the fan-out's lock, whether the
fan-out is over (store/fan_outs.py says why that is enough). The one that finds it over gathers the
results in the items' order and moves the token on through the ordinary move, in the same transaction.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import Node, Process
from abada_engine.runtime.calls import follow_calls
from abada_engine.runtime.flow.navigator import HistoryEntry, leave_node
from abada_engine.runtime.flow.tokens import advance_move, history_record
from abada_engine.store import fan_outs as fan_out_store
from abada_engine.store import instances as instance_store
from abada_engine.store.fan_outs import FinishedItem, ItemEnd
from abada_engine.store.hand_written import Executor
from abada_engine.store.moves import move_token
from abada_engine.store.states import InstanceState, TaskState


def item_result(node: Node, written: dict[str, Any]) -> Any:
    """What an item's completion gives `collect`: its `result_variable` (null when it wrote none)."""
    return written.get(node.result_variable) if node.result_variable else None


async def end_item(
    conn: AsyncConnection,
    catalog: DefinitionCatalog,
    process: Process,
    node: Node,
    instance_id: uuid.UUID,
    end: ItemEnd,
) -> FinishedItem | None:
    """End an item in the caller's transaction (`item_end`); None when its lease or state no longer
    held, and nothing was written. The last item's end also moves the token on."""
    finished = await finish_item(conn, end)
    if finished is not None and finished.may_be_last:
        await end_fan_out_if_done(conn, catalog, process, node, instance_id, finished.fan_out_id)
    return finished


async def finish_item(conn: Executor, end: ItemEnd) -> FinishedItem | None:
    """`end_item`'s one statement alone. When it answers `may_be_last`, the caller asks
    `end_fan_out_if_done` next; if it dies first, `FanOutEnds` asks for it."""
    [finished] = await fan_out_store.finish_items(conn, [end])
    return finished


def item_end(
    instance_id: uuid.UUID,
    task_id: uuid.UUID,
    state: TaskState,
    result: Any,
    history: list[HistoryEntry],
    *,
    guard_worker: str | None = None,
    guard_hash: bytes | None = None,
    from_state: TaskState | None = None,
) -> ItemEnd:
    """An item's end: COMPLETED with its result, or SKIPPED, with its history lines; under its lease
    (`guard_worker`, `guard_hash`) or only while it is in `from_state`."""
    return ItemEnd(
        task_id,
        state,
        result,
        [history_record(instance_id, entry, task_id) for entry in history],
        guard_worker,
        guard_hash,
        from_state,
    )


async def end_fan_out_if_done(
    conn: AsyncConnection,
    catalog: DefinitionCatalog,
    process: Process,
    node: Node,
    instance_id: uuid.UUID,
    fan_out_id: uuid.UUID,
) -> None:
    # The instance first, then the fan-out: the order a cancel takes them in (it withdraws the items
    # and ends the fan-out while holding the instance), so the two never wait on each other in a circle.
    instance = await instance_store.lock(conn, instance_id)
    if instance is None or instance.state != InstanceState.ACTIVE:
        return
    ended = await fan_out_store.end_if_done(conn, fan_out_id)
    if ended is None:
        return
    written = {node.collect: ended.results} if node.collect else {}
    _, leaving, moved = leave_node(process, node, instance.variables, written)
    completed = HistoryEntry(
        "FAN_OUT_COMPLETED",
        node.id,
        {"fan_out_id": str(fan_out_id), "items": len(ended.results), "skipped": ended.skipped},
    )
    move = advance_move(
        instance_id=instance_id, advance=moved, variables=written, preceding=[completed, *leaving]
    )
    await move_token(conn, move)
    # The node after the fan-out may call a process, or the fan-out may have ended a called instance.
    await follow_calls(conn, catalog, [move])


class FanOutEnds:
    """Ends the fan-outs whose last item ended without deciding it (its replica died between the item's
    statement and the decision): a periodic duty, on every replica (the fan-out's lock keeps it once)."""

    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog) -> None:
        self._engine = engine
        self._catalog = catalog

    async def round(self) -> int:
        async with self._engine.connect() as conn:
            unended = await fan_out_store.unended(conn)
        for fan in unended:
            definition = await self._catalog.get(fan.definition_id)
            process = definition.process
            async with self._engine.begin() as conn:
                await end_fan_out_if_done(
                    conn, self._catalog, process, process.node(fan.node_id), fan.instance_id, fan.id
                )
        return len(unended)
