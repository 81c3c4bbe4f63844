"""Process instances: starting, reading, cancelling, and the user tasks people complete."""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.db.schema import history, incidents, instances, tasks
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import Category, EngineError, invalid, not_found

from .navigator import HistoryEntry, advance, leave_node
from .tokens import apply_advance, history_row, write_history
from .views import HistoryView, InstanceView, UserTaskView

INSTANCE_STATES = ("ACTIVE", "COMPLETED", "CANCELED")
MAX_VARIABLES_BYTES = 1_000_000


class Instances:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog

    async def start(
        self, process_id: str, version: int, variables: dict[str, Any], business_key: str = ""
    ) -> InstanceView:
        if not process_id:
            raise invalid("INVALID_ARGUMENT", "process_id", "is required")
        definition = await self._catalog.find(process_id, version)
        instance_id = uuid.uuid4()
        async with self._engine.begin() as conn:
            created_at = (
                await conn.execute(
                    insert(instances)
                    .values(
                        id=instance_id,
                        definition_id=definition.id,
                        process_id=definition.process_id,
                        version=definition.version,
                        state="ACTIVE",
                        variables=variables,
                        current_node_id=definition.process.start,
                        business_key=business_key,
                        created_at=func.now(),
                    )
                    .returning(instances.c.created_at)
                )
            ).scalar_one()
            started = HistoryEntry(
                "INSTANCE_STARTED",
                None,
                {"definition_id": str(definition.id), "version": definition.version, "variables": variables},
            )
            moved = advance(definition.process, variables, definition.process.start)
            await apply_advance(
                conn, instance_id=instance_id, advance=moved, variables=None, preceding=[started]
            )
        return InstanceView(
            id=instance_id,
            definition_id=definition.id,
            process_id=definition.process_id,
            version=definition.version,
            state="COMPLETED" if moved.completed else "ACTIVE",
            variables=variables,
            current_node_id=moved.current_node_id,
            business_key=business_key,
            created_at=created_at,
            ended_at=None,
            open_incidents=1 if moved.incident else 0,
        )

    async def get(self, instance_id: uuid.UUID) -> InstanceView:
        rows = await self._query(instances.c.id == instance_id, limit=1)
        if not rows:
            raise not_found("instance", str(instance_id), "instance_id")
        return rows[0]

    async def list(
        self, process_id: str = "", state: str = "", limit: int = 100, offset: int = 0
    ) -> list[InstanceView]:
        condition = instances.c.id.is_not(None)
        if process_id:
            condition = condition & (instances.c.process_id == process_id)
        if state:
            condition = condition & (instances.c.state == state)
        return await self._query(condition, limit=limit, offset=offset)

    async def _query(self, condition: Any, limit: int, offset: int = 0) -> list[InstanceView]:
        open_incidents = (
            select(func.count())
            .where(incidents.c.instance_id == instances.c.id, incidents.c.state == "OPEN")
            .scalar_subquery()
        )
        query = (
            select(instances, open_incidents.label("open_incidents"))
            .where(condition)
            .order_by(instances.c.created_at.desc(), instances.c.id)
            .limit(limit)
            .offset(offset)
        )
        async with self._reads.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            InstanceView(
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
            )
            for r in rows
        ]

    async def history(self, instance_id: uuid.UUID) -> list[HistoryView]:
        await self.get(instance_id)
        async with self._reads.connect() as conn:
            rows = (
                await conn.execute(
                    select(history).where(history.c.instance_id == instance_id).order_by(history.c.id)
                )
            ).all()
        return [
            HistoryView(r.id, r.instance_id, r.type, r.node_id, r.task_id, r.data, r.created_at) for r in rows
        ]

    async def cancel(self, instance_id: uuid.UUID, reason: str) -> InstanceView:
        async with self._engine.begin() as conn:
            await cancel_instance(conn, instance_id, reason)
        return await self.get(instance_id)

    async def user_tasks(self, instance_id: uuid.UUID | None) -> list[UserTaskView]:
        query = (
            select(
                tasks.c.id,
                tasks.c.instance_id,
                tasks.c.node_id,
                tasks.c.payload,
                tasks.c.created_at,
                instances.c.process_id,
            )
            .join(instances, instances.c.id == tasks.c.instance_id)
            .where(tasks.c.kind == "user", tasks.c.state == "WAITING")
            .order_by(tasks.c.created_at)
        )
        if instance_id is not None:
            query = query.where(tasks.c.instance_id == instance_id)
        async with self._reads.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            UserTaskView(r.id, r.instance_id, r.node_id, r.process_id, r.payload, r.created_at) for r in rows
        ]

    async def complete_user_task(self, user_task_id: uuid.UUID, variables: dict[str, Any]) -> InstanceView:
        async with self._engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT t.id, t.instance_id, t.node_id, t.state, t.kind, i.definition_id, i.variables "
                        "FROM tasks t JOIN instances i ON i.id = t.instance_id WHERE t.id = :id FOR UPDATE OF t, i"
                    ),
                    {"id": user_task_id},
                )
            ).one_or_none()
            if row is None or row.kind != "user":
                raise not_found("user task", str(user_task_id), "user_task_id")
            if row.state != "WAITING":
                raise EngineError(
                    Category.FAILED_PRECONDITION,
                    "TASK_NOT_WAITING",
                    f"user task {user_task_id} is {row.state.lower()}",
                    field="user_task_id",
                )
            definition = await self._catalog.get(row.definition_id)
            node = definition.process.node(row.node_id)
            await conn.execute(
                text("UPDATE tasks SET state = 'COMPLETED', completed_at = now() WHERE id = :id"),
                {"id": user_task_id},
            )
            new_variables, leaving, moved = leave_node(definition.process, node, row.variables, variables)
            preceding = [HistoryEntry("USER_TASK_COMPLETED", node.id), *leaving]
            await apply_advance(
                conn,
                instance_id=row.instance_id,
                advance=moved,
                variables=new_variables,
                preceding=preceding,
                preceding_task_id=user_task_id,
            )
            instance_id = row.instance_id
        return await self.get(instance_id)


async def cancel_instance(conn: Any, instance_id: uuid.UUID, reason: str) -> None:
    """Cancel an active instance with its open tasks and incidents, in the caller's transaction."""
    state = (
        await conn.execute(text("SELECT state FROM instances WHERE id = :id FOR UPDATE"), {"id": instance_id})
    ).scalar_one_or_none()
    if state is None:
        raise not_found("instance", str(instance_id), "instance_id")
    if state != "ACTIVE":
        raise EngineError(
            Category.FAILED_PRECONDITION,
            "INSTANCE_NOT_ACTIVE",
            f"instance {instance_id} is {state.lower()}",
            field="instance_id",
        )
    await conn.execute(
        text(
            "UPDATE tasks SET state = 'CANCELED', lease_token_hash = NULL WHERE instance_id = :id "
            "AND state IN ('READY', 'LEASED', 'WAITING', 'INCIDENT')"
        ),
        {"id": instance_id},
    )
    await conn.execute(
        text(
            "UPDATE incidents SET state = 'RESOLVED', resolved_at = now(), resolution = 'INSTANCE_CANCELED' "
            "WHERE instance_id = :id AND state = 'OPEN'"
        ),
        {"id": instance_id},
    )
    await conn.execute(
        text("UPDATE instances SET state = 'CANCELED', ended_at = now() WHERE id = :id"), {"id": instance_id}
    )
    await write_history(
        conn, [history_row(instance_id, HistoryEntry("INSTANCE_CANCELED", None, {"reason": reason}))]
    )
