"""Process instances: starting, reading, cancelling, and the user tasks people complete."""

from __future__ import annotations

import asyncio
import builtins  # builtins.list: annotations after the class's own `list` method, which shadows it
import logging
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.group_commit import GroupCommit
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import Node, Process
from abada_engine.definitions.schemas import input_problem
from abada_engine.errors import Category, EngineError, invalid, not_active, not_found, precondition
from abada_engine.ids import new_id
from abada_engine.runtime.calls import answer_parent_of_canceled, creates_call, follow_calls
from abada_engine.runtime.flow.items import end_item, item_end, item_result
from abada_engine.runtime.flow.navigator import (
    HistoryEntry,
    advance,
    evaluates_conditions,
    leave_node,
)
from abada_engine.runtime.flow.tokens import (
    advance_move,
    history_record,
    move_in_locked_instance,
    start_move,
    withdraw_tokens,
    write_history,
)
from abada_engine.runtime.offload import run_cpu_check, run_cpu_work
from abada_engine.runtime.views import HistoryView, InstanceView, UserTaskView, WaitView
from abada_engine.store import calls as call_store
from abada_engine.store import fan_outs as fan_out_store
from abada_engine.store import history as history_store
from abada_engine.store import instances as instance_store
from abada_engine.store import tasks as task_store
from abada_engine.store import timers as timer_store
from abada_engine.store import tokens as token_store
from abada_engine.store.hand_written import HotPath
from abada_engine.store.instances import InstanceListing, InstanceRow, ListedInstance
from abada_engine.store.moves import (
    NewInstance,
    StartToWrite,
    TokenMove,
    start_instance_once,
    start_instances,
)
from abada_engine.store.states import InstanceState, TaskKind, TaskState
from abada_engine.store.tasks import LockedTaskRow

log = logging.getLogger(__name__)

INSTANCE_STATES = tuple(InstanceState)
MAX_VARIABLES_BYTES = 1_000_000
# How much of an inputs check runs inline on the event loop before it moves to the bounded executor.
_INPUT_CHECK_INLINE_STEPS = 2_000
# A start retried only because another replica deployed a newer version meanwhile.
_STARTS_BEFORE_GIVING_UP = 3


async def _check_inputs(process: Process, version: int, variables: dict[str, Any]) -> None:
    """The variables meet the process's declared `inputs:`, or nothing starts (INVALID_ARGUMENT).

    The schema is checked on the caller's data as an output is: under a work budget, and off the event
    loop when it could take long (`offload`)."""
    if process.input_schema is None:
        return
    problem = await run_cpu_check(
        True, _INPUT_CHECK_INLINE_STEPS, input_problem, process.input_schema, variables
    )
    if problem is None:
        return
    name, why = problem
    field_name = f"variables.{name}" if name else "variables"
    raise invalid(
        ErrorReason.VARIABLES_INVALID, field_name, f"{why} ({process.id} v{version} declares its inputs)"
    )


@dataclass(frozen=True, slots=True)
class Started:
    instance: InstanceView
    # The start's request id matched an earlier start, whose instance this is.
    already_started: bool = False


class Instances:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog, hot: HotPath | None = None) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._hot = hot if hot is not None else HotPath(engine)
        self._catalog = catalog
        # Starts arriving together share one statement and one commit; one that fails is tried alone.
        self._starts = GroupCommit(
            self._hot.batch_statement(start_instances), max_batch=64, each_alone_on_failure=True
        )

    async def start(
        self,
        process_id: str,
        version: int,
        variables: dict[str, Any],
        business_key: str = "",
        request_id: str = "",
    ) -> Started:
        """Start an instance of the process's `version` (0: the latest). With a `request_id` seen within a
        day nothing starts and the first start's instance is answered; a process with
        `unique_business_key` refuses a key an active instance holds (ALREADY_EXISTS)."""
        if not process_id:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "process_id", "is required")
        # The latest version as this replica remembers it, re-checked by the write itself: one
        # statement per start instead of a read and a write; on a miss, read it and write again.
        definition = await self._catalog.find_remembered(process_id, version)
        for _ in range(_STARTS_BEFORE_GIVING_UP):
            instance_id = new_id()
            started = HistoryEntry(
                "INSTANCE_STARTED",
                None,
                {"definition_id": str(definition.id), "version": definition.version, "variables": variables},
            )
            process = definition.process
            if process.unique_business_key and not business_key:
                raise invalid(
                    ErrorReason.INVALID_ARGUMENT,
                    "business_key",
                    f"is required: {process_id} v{definition.version} takes one active instance per key",
                )
            await _check_inputs(process, definition.version, variables)
            moved = await run_cpu_work(
                evaluates_conditions(process, process.start), advance, process, variables, process.start
            )
            new = NewInstance(
                instance_id,
                definition.id,
                definition.process_id,
                definition.version,
                {**variables, **moved.written} if moved.written else variables,
                business_key,
            )
            write = StartToWrite(new, start_move(instance_id, moved, [started]), must_be_latest=not version)
            # A start that forks writes its branches beside the instance, one that calls starts the
            # child with it: in a transaction of its own.
            if (
                request_id
                or process.unique_business_key
                or write.first_move.branches
                or creates_call(write.first_move)
            ):
                created_at = await self._start_once(write, request_id, process.unique_business_key)
                if isinstance(created_at, InstanceView):
                    return Started(created_at, already_started=True)
            else:
                created_at = await self._starts.submit(write)
            if created_at is not None:
                break
            definition = await self._catalog.find(process_id)
        else:
            raise EngineError(
                Category.ABORTED,
                ErrorReason.CONCURRENT_CHANGE,
                f"new versions of {process_id!r} kept being deployed while starting it; try again",
            )
        # One line per start, for an operator following a case from the log (the variables stay out:
        # they are the caller's data).
        log.info(
            "instance started",
            extra={
                "instance_id": str(instance_id),
                "process_id": definition.process_id,
                "definition_id": str(definition.id),
                "version": definition.version,
                "business_key": business_key,
            },
        )
        if creates_call(write.first_move):
            # Its child may have ended at once and moved it on: as it is now, children and all.
            return Started(await self.get(instance_id))
        return Started(
            InstanceView(
                id=instance_id,
                definition_id=definition.id,
                process_id=definition.process_id,
                version=definition.version,
                state=InstanceState.COMPLETED if moved.completed else InstanceState.ACTIVE,
                variables=variables,
                current_node_id=moved.current_node_id,
                business_key=business_key,
                created_at=created_at,
                ended_at=None,
                open_incidents=1 if moved.incident else 0,
            )
        )

    async def _start_once(
        self, write: StartToWrite, request_id: str, unique_business_key: bool
    ) -> datetime | InstanceView | None:
        """A start that must happen once, in a transaction of its own (outside the group commit: a
        refusal must not fail the starts batched with it). Answers when it was created, the earlier
        start's instance, or None when a newer version was deployed meanwhile."""
        async with self._engine.begin() as conn:
            outcome = await start_instance_once(conn, write, request_id, unique_business_key)
            if outcome.created_at is None:
                await conn.rollback()
            else:
                await follow_calls(conn, self._catalog, [write.first_move])
        if outcome.started_before is not None:
            return await self.get(outcome.started_before)
        if outcome.key_held_by is not None:
            instance = write.instance
            raise EngineError(
                Category.ALREADY_EXISTS,
                ErrorReason.BUSINESS_KEY_ACTIVE,
                f"{instance.process_id} already has an active instance ({outcome.key_held_by}) with "
                f"business key {instance.business_key!r}",
                field="business_key",
                metadata={"instance_id": str(outcome.key_held_by)},
            )
        return outcome.created_at

    async def get(self, instance_id: uuid.UUID) -> InstanceView:
        async with self._reads.connect() as conn:
            rows = await instance_store.listed(conn, instance_id=instance_id, limit=1)
            waits = await timer_store.waits_of_instance(conn, instance_id) if rows else []
            active = await token_store.active_nodes(conn, instance_id) if rows else []
            fanned = await fan_out_store.progress_of_instance(conn, instance_id) if rows else []
            children = await call_store.children_of(conn, instance_id) if rows else []
        if not rows:
            raise not_found("instance", str(instance_id), "instance_id")
        return replace(
            _view(rows[0]),
            waits=tuple(WaitView(**asdict(w)) for w in waits),
            active_node_ids=tuple(active),
            fan_outs=tuple(fanned),
            children=tuple(children),
        )

    async def list(
        self,
        which: InstanceListing,
        limit: int = 100,
        after_key: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[InstanceView]:
        """Instances newest first; with `waiting_for` (TIMER or RECEIVE), only those waiting on one."""
        async with self._reads.connect() as conn:
            rows = await instance_store.listed(conn, which, limit=limit, after_key=after_key)
        return [_view(r) for r in rows]

    async def history(self, instance_id: uuid.UUID) -> builtins.list[HistoryView]:
        await self.get(instance_id)
        async with self._reads.connect() as conn:
            rows = await history_store.of_instance(conn, instance_id)
        return [
            HistoryView(r.id, r.instance_id, r.type, r.node_id, r.task_id, r.data, r.created_at) for r in rows
        ]

    async def cancel(self, instance_id: uuid.UUID, reason: str) -> InstanceView:
        async with self._engine.begin() as conn:
            await cancel_instance(conn, instance_id, reason)
        return await self.get(instance_id)

    async def user_tasks(
        self,
        instance_id: uuid.UUID | None,
        limit: int = 1000,
        after_key: tuple[datetime, uuid.UUID] | None = None,
    ) -> builtins.list[UserTaskView]:
        async with self._reads.connect() as conn:
            rows = await task_store.waiting_user_tasks(conn, instance_id, limit, after_key)
        return [
            UserTaskView(r.id, r.instance_id, r.node_id, r.process_id, r.payload, r.created_at) for r in rows
        ]

    async def complete_user_task(self, user_task_id: uuid.UUID, variables: dict[str, Any]) -> InstanceView:
        async with self._engine.begin() as conn:
            row = await task_store.lock_task_and_instance(conn, user_task_id)
            if row is None or row.kind != TaskKind.USER:
                raise not_found("user task", str(user_task_id), "user_task_id")
            if row.state != TaskState.WAITING:
                raise precondition(
                    ErrorReason.TASK_NOT_WAITING,
                    f"user task {user_task_id} is {row.state.lower()}",
                    "user_task_id",
                )
            definition = await self._catalog.get(row.definition_id)
            node = definition.process.node(row.node_id)
            if node.fans_out:
                # An item of a `for_each`: what the person wrote is the item's result, not the instance's.
                completed = [HistoryEntry("USER_TASK_COMPLETED", node.id)]
                end = item_end(
                    row.instance_id,
                    user_task_id,
                    TaskState.COMPLETED,
                    item_result(node, variables),
                    completed,
                    from_state=TaskState.WAITING,
                )
                await end_item(conn, self._catalog, definition.process, node, row.instance_id, end)
            else:
                await self._leave_user_task(conn, row, node, definition.process, variables)
            instance_id = row.instance_id
        return await self.get(instance_id)

    async def _leave_user_task(
        self,
        conn: AsyncConnection,
        row: LockedTaskRow,
        node: Node,
        process: Process,
        variables: dict[str, Any],
    ) -> None:
        """A user task done: the token moves on with what the person wrote."""
        user_task_id = row.id
        await task_store.mark_task_completed(conn, user_task_id)

        async def decide(tokens_elsewhere: int | None) -> TokenMove:
            _, leaving, moved = await asyncio.to_thread(
                leave_node, process, node, row.variables, variables, tokens_elsewhere
            )
            return advance_move(
                instance_id=row.instance_id,
                advance=moved,
                # Only what the person wrote: a branch moving beside this one keeps its writes.
                variables=variables,
                preceding=[HistoryEntry("USER_TASK_COMPLETED", node.id), *leaving],
                preceding_task_id=user_task_id,
            )

        move = await move_in_locked_instance(conn, row.instance_id, user_task_id, decide)
        await follow_calls(conn, self._catalog, [move])


def _view(r: ListedInstance) -> InstanceView:
    return InstanceView(
        r.id,
        r.definition_id,
        r.process_id,
        r.version,
        r.state,
        r.variables,
        r.current_node_id,
        r.business_key,
        r.created_at,
        r.ended_at,
        r.open_incidents,
        r.parent_instance_id,
    )


async def lock_active_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> InstanceRow:
    """The instance, locked for a change only a running instance takes; refused when there is no such
    instance or it has ended."""
    instance = await instance_store.lock(conn, instance_id)
    if instance is None:
        raise not_found("instance", str(instance_id), "instance_id")
    if instance.state != InstanceState.ACTIVE:
        raise not_active(instance_id, instance.state)
    return instance


async def cancel_instance(conn: AsyncConnection, instance_id: uuid.UUID, reason: str) -> None:
    """Cancel an active instance with its open tasks and incidents, in the caller's transaction."""
    await lock_active_instance(conn, instance_id)
    await withdraw_tokens(conn, instance_id, f"the instance was cancelled: {reason}")
    await instance_store.mark_canceled(conn, instance_id)
    await write_history(
        conn, [history_record(instance_id, HistoryEntry("INSTANCE_CANCELED", None, {"reason": reason}))]
    )
    await answer_parent_of_canceled(conn, instance_id)
