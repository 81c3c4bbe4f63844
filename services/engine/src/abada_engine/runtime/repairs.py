"""Repairing running instances: an operator sets or removes variables and moves tokens (ModifyInstance),
or moves instances to another version of their process under a checked plan (MigrateInstances).

Both follow Camunda 8's semantics where the issue is silent: a modification is applied as one unit
(all or nothing) and every change is one history entry naming who made it and why; a migration plan is
checked for every instance before any moves, a node keeps its id unless the plan maps it, and a node
may only become a node of the same type.

`modify_instance` and `migrate_instance` work in the caller's transaction, one instance at a time, so
a batch runs them per instance under its own transactions."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.definitions.catalog import Definition, DefinitionCatalog
from abada_engine.errors import EngineError, invalid, not_found, precondition
from abada_engine.runtime.calls import follow_calls
from abada_engine.runtime.flow.navigator import HistoryEntry, advance, task_payload
from abada_engine.runtime.flow.tokens import (
    advance_move,
    cancel_called,
    history_record,
    move_through_join,
    write_history,
)
from abada_engine.runtime.instances import lock_active_instance
from abada_engine.runtime.waits import WithdrawnTask, close_withdrawn
from abada_engine.store import incidents as incident_store
from abada_engine.store import repairs as repair_store
from abada_engine.store.moves import TokenMove
from abada_engine.store.states import TaskState

_MOVED = "an operator moved the token away"
_WRITE_IN_FLIGHT = "an operator moved the token away while this write was in flight"


@dataclass(frozen=True)
class Modification:
    """What one ModifyInstance changes: variables set (whole values) and removed, tokens moved."""

    reason: str
    set_variables: dict[str, Any] = field(default_factory=dict)
    unset_variables: tuple[str, ...] = ()
    # (from node, to node): the token resting at the first goes to the second.
    moves: tuple[tuple[str, str], ...] = ()


def check_modification(change: Modification) -> None:
    """Refuse a modification that says no reason or changes nothing, before any instance is touched."""
    if not change.reason.strip():
        raise invalid(ErrorReason.INVALID_ARGUMENT, "reason", "say why: it is kept in the history")
    if not (change.set_variables or change.unset_variables or change.moves):
        raise invalid(ErrorReason.INVALID_ARGUMENT, "set_variables", "nothing to change")


async def modify_instance(
    conn: AsyncConnection,
    catalog: DefinitionCatalog,
    instance_id: uuid.UUID,
    change: Modification,
    by: str,
) -> None:
    """Apply `change` to one active instance in the caller's transaction: variables first (so a moved
    token walks on the corrected values), then the moves, each withdrawing the task it leaves."""
    check_modification(change)
    instance = await lock_active_instance(conn, instance_id)
    definition = await catalog.get(instance.definition_id)
    process = definition.process
    for index, (from_node, to_node) in enumerate(change.moves):
        if from_node in process.nodes and process.node(from_node).fans_out:
            # Its items are tokens of their own: moving one would leave the others.
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                f"moves[{index}].from_node_id",
                f"{from_node!r} runs for_each: moving a token out of its items is not supported yet",
            )
        if to_node not in process.nodes:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                f"moves[{index}].to_node_id",
                f"{process.id} v{definition.version} has no node {to_node!r}",
            )
    who = {"by": by, "reason": change.reason}
    records = [
        history_record(instance_id, HistoryEntry("VARIABLE_UNSET", None, {"name": name, **who}))
        for name in change.unset_variables
    ]
    records += [
        history_record(instance_id, HistoryEntry("VARIABLE_SET", None, {"name": name, "value": value, **who}))
        for name, value in change.set_variables.items()
    ]
    if records:
        await repair_store.change_variables(conn, instance_id, change.set_variables, change.unset_variables)
        await write_history(conn, records)
    variables = {k: v for k, v in instance.variables.items() if k not in change.unset_variables}
    variables.update(change.set_variables)
    for index, (from_node, to_node) in enumerate(change.moves):
        await _move_token(conn, catalog, definition, instance_id, variables, from_node, to_node, who, index)


async def _move_token(
    conn: AsyncConnection,
    catalog: DefinitionCatalog,
    definition: Definition,
    instance_id: uuid.UUID,
    variables: dict[str, Any],
    from_node: str,
    to_node: str,
    who: dict[str, str],
    index: int,
) -> None:
    task = await repair_store.lock_open_task_at(conn, instance_id, from_node)
    incident_id = None
    if task is None:
        # A token stuck on an incident that holds no task (a gateway no branch matched): the
        # incident closes and the token goes on from `to_node`.
        incident_id = await repair_store.lock_taskless_incident_at(conn, instance_id, from_node)
        if incident_id is None:
            raise precondition(
                ErrorReason.NO_TOKEN_AT_NODE,
                f"no token of instance {instance_id} rests at {from_node!r}",
                f"moves[{index}].from_node_id",
            )
        # Closed before the tokens are counted: this one is moving, not waiting elsewhere.
        await incident_store.close(conn, incident_id, "TOKEN_MOVED")
    moved = HistoryEntry(
        "TOKEN_MOVED",
        from_node,
        {
            "from_node_id": from_node,
            "to_node_id": to_node,
            **({"task_state": task.state} if task else {"incident_id": str(incident_id)}),
            **who,
        },
    )

    async def decide(tokens_elsewhere: int) -> TokenMove:
        # The withdrawn task ends CANCELED with its lease revoked, as a passed deadline leaves it.
        return advance_move(
            instance_id=instance_id,
            advance=advance(definition.process, variables, to_node, tokens_elsewhere=tokens_elsewhere),
            variables=None,
            preceding=[moved],
            preceding_task_id=task.id if task else None,
            finished_task_id=task.id if task else None,
            finished_state=TaskState.CANCELED,
            only_if_open=task is not None,
        )

    leaving = task.id if task else None
    move, written = await move_through_join(conn, instance_id, leaving, None, decide, instance_locked=True)
    if not written:  # the instance row is locked: only a vanished instance gets here
        raise not_found("instance", str(instance_id), "instance_id")
    if task is not None:
        # A token moved away from a call activity takes its child with it.
        await cancel_called(conn, instance_id, _MOVED, only_task=task.id)
    await follow_calls(conn, catalog, [move])
    if task is not None:
        withdrawn = WithdrawnTask(task.id, instance_id, from_node, task.state, definition)
        await close_withdrawn(conn, [withdrawn], _MOVED, "TOKEN_MOVED", _WRITE_IN_FLIGHT)


@dataclass(frozen=True)
class MigrationPlan:
    """A checked plan: the instances that move and, for each node holding one of their tokens, the
    node of the target version it becomes."""

    source: Definition
    target: Definition
    instance_ids: tuple[uuid.UUID, ...]
    nodes: dict[str, str]


async def migration_versions(
    catalog: DefinitionCatalog, process_id: str, from_version: int, to_version: int, mappings: dict[str, str]
) -> tuple[Definition, Definition]:
    """The definitions a migration leaves and reaches, once the versions and the mapped nodes are checked."""
    if from_version <= 0 or to_version <= 0:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "to_version", "name both versions (1 or more)")
    if from_version == to_version:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "to_version", "is the version the instances are on")
    source = await catalog.find(process_id, from_version)
    target = await catalog.find(process_id, to_version)
    for old in mappings:
        if old not in source.process.nodes:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "mappings", f"{process_id} v{from_version} has no node {old!r}"
            )
    return source, target


async def plan_migration(
    conn: AsyncConnection,
    catalog: DefinitionCatalog,
    process_id: str,
    from_version: int,
    to_version: int,
    mappings: dict[str, str],
    instance_ids: Sequence[uuid.UUID] = (),
) -> MigrationPlan:
    """Check the migration of the active instances of `process_id` v`from_version` (only
    `instance_ids` when given) to `to_version` before anything moves; refused whole, naming the node,
    when a node holding a token has no node of the same type in the target version."""
    source, target = await migration_versions(catalog, process_id, from_version, to_version, mappings)
    return await plan_between(conn, source, target, mappings, instance_ids)


async def plan_between(
    conn: AsyncConnection,
    source: Definition,
    target: Definition,
    mappings: dict[str, str],
    instance_ids: Sequence[uuid.UUID] = (),
) -> MigrationPlan:
    """`plan_migration` between two definitions already found and checked."""
    process_id, from_version, to_version = source.process_id, source.version, target.version
    ids = await repair_store.active_of_definition(conn, source.id, instance_ids)
    if instance_ids:
        missing = set(instance_ids) - set(ids)
        if missing:
            raise precondition(
                ErrorReason.INSTANCE_NOT_ACTIVE,
                f"not active on {process_id} v{from_version}: {', '.join(sorted(map(str, missing)))}",
                "instance_ids",
            )
    held = set().union(*(await repair_store.token_nodes(conn, ids)).values()) if ids else set()
    nodes: dict[str, str] = {}
    refused: dict[str, str] = {}
    for old in sorted(held):
        new = mappings.get(old, old)
        old_type = source.process.node(old).type
        if new not in target.process.nodes:
            refused[old] = f"{process_id} v{to_version} has no node {new!r}; map it with --map"
        elif target.process.node(new).type != old_type:
            new_type = target.process.node(new).type
            refused[old] = f"{old!r} is a {old_type} node, {new!r} in v{to_version} a {new_type}"
        else:
            nodes[old] = new
    if refused:
        # Every node that cannot be mapped at once, so one dry run shows the whole repair to make.
        raise precondition(
            ErrorReason.MIGRATION_PLAN_INVALID,
            "the migration plan cannot map "
            + "; ".join(f"node {node!r}: {why}" for node, why in refused.items()),
            "mappings",
            metadata={"node_id": next(iter(refused)), "node_ids": ",".join(refused)},
        )
    return MigrationPlan(source, target, tuple(ids), nodes)


def _unmappable(node_id: str, why: str) -> EngineError:
    return precondition(
        ErrorReason.MIGRATION_PLAN_INVALID,
        f"the migration plan cannot map node {node_id!r}: {why}",
        "mappings",
        metadata={"node_id": node_id},
    )


async def migrate_instance(
    conn: AsyncConnection, plan: MigrationPlan, instance_id: uuid.UUID, by: str
) -> bool:
    """Move one instance of a checked plan to the target version in the caller's transaction; False
    when it is no longer active on the source version (it finished or moved meanwhile). A token
    resting at a node the plan does not cover (it moved since the plan) refuses the instance.

    Each open task keeps its id, attempt and lease: an attempt in flight finishes on its lease, and
    whatever fetches the task next gets the target version's prompt, inputs, tools and bindings."""
    locked = await repair_store.lock_active(conn, instance_id, plan.source.id)
    if locked is None:
        return False
    current, variables = locked
    open_tasks = await repair_store.lock_open_tasks(conn, instance_id)
    for task in open_tasks:
        if task.node_id not in plan.nodes:
            raise _unmappable(task.node_id, "a token reached it after the plan was checked")
    target = plan.target.process
    for task in open_tasks:
        new_node = target.node(plan.nodes[task.node_id])
        payload = task_payload(new_node, variables)
        if "context" in task.payload:  # why it was asked again (a rejected output): still true
            payload["context"] = task.payload["context"]
        await repair_store.rename_open_task(conn, task.id, new_node.id, payload)
    renames = {old: new for old, new in plan.nodes.items() if old != new}
    await repair_store.rename_waiting_nodes(conn, instance_id, renames)
    await repair_store.move_to_definition(
        conn, instance_id, plan.target.id, plan.target.version, plan.nodes.get(current, current)
    )
    entry = HistoryEntry(
        "INSTANCE_MIGRATED",
        None,
        {
            "from_definition_id": str(plan.source.id),
            "from_version": plan.source.version,
            "to_definition_id": str(plan.target.id),
            "to_version": plan.target.version,
            "nodes": renames,
            "by": by,
        },
    )
    await write_history(conn, [history_record(instance_id, entry)])
    return True


@dataclass(frozen=True)
class Migrated:
    nodes: dict[str, str]
    instances: int
    dry_run: bool


class Repairs:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog) -> None:
        self._engine = engine
        self._catalog = catalog

    async def modify(self, instance_id: uuid.UUID, change: Modification, by: str) -> None:
        async with self._engine.begin() as conn:
            await modify_instance(conn, self._catalog, instance_id, change, by)

    async def migrate(
        self,
        process_id: str,
        from_version: int,
        to_version: int,
        mappings: dict[str, str],
        instance_ids: Sequence[uuid.UUID],
        dry_run: bool,
        by: str,
    ) -> Migrated:
        """Check the plan, then (unless `dry_run`) move each instance in a short transaction of its own,
        so live traffic on the others goes on."""
        async with self._engine.connect() as conn:
            plan = await plan_migration(
                conn, self._catalog, process_id, from_version, to_version, mappings, instance_ids
            )
        if dry_run:
            return Migrated(plan.nodes, len(plan.instance_ids), True)
        moved = 0
        for instance_id in plan.instance_ids:
            async with self._engine.begin() as conn:
                moved += await migrate_instance(conn, plan, instance_id, by)
        return Migrated(plan.nodes, moved, False)
