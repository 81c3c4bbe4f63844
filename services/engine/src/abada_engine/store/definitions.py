"""Frozen process definitions: one row per deployed version, never changed once written."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import definitions
from abada_engine.ids import new_id

from .hand_written import typed


@dataclass(slots=True)
class DefinitionRow:
    id: uuid.UUID
    process_id: str
    version: int
    content_sha256: str
    source_name: str
    spec: dict[str, Any]
    tool_bindings: list[dict[str, Any]]
    created_at: datetime
    # None for a version deployed before retention existed (migration 0011).
    retention_seconds: float | None


def _row(row: Any) -> DefinitionRow | None:
    return typed(DefinitionRow, row._mapping) if row is not None else None


async def lock_for_deploy(conn: AsyncConnection) -> None:
    """Serialise deploys until the transaction ends: two must not take the same next version number."""
    await conn.execute(select(func.pg_advisory_xact_lock(func.hashtext("abada.deploy"))))


async def latest(conn: AsyncConnection, process_id: str) -> DefinitionRow | None:
    query = (
        select(definitions)
        .where(definitions.c.process_id == process_id)
        .order_by(definitions.c.version.desc())
        .limit(1)
    )
    return _row((await conn.execute(query)).one_or_none())


async def record_retention(conn: AsyncConnection, definition_id: uuid.UUID, retention_seconds: float) -> None:
    """Give a version deployed before retention existed the retention its process now declares (a
    version that has one keeps it)."""
    await conn.execute(
        update(definitions)
        .where(definitions.c.id == definition_id, definitions.c.retention_seconds.is_(None))
        .values(retention_seconds=retention_seconds)
    )


async def insert_version(
    conn: AsyncConnection,
    process_id: str,
    version: int,
    content_sha256: str,
    source_name: str,
    spec: dict[str, Any],
    tool_bindings: list[dict[str, Any]],
    retention_seconds: float,
) -> DefinitionRow:
    row = (
        await conn.execute(
            insert(definitions)
            .values(
                id=new_id(),
                process_id=process_id,
                version=version,
                content_sha256=content_sha256,
                source_name=source_name,
                spec=spec,
                tool_bindings=tool_bindings,
                retention_seconds=retention_seconds,
                created_at=func.now(),
            )
            .returning(*definitions.c)
        )
    ).one()
    return typed(DefinitionRow, row._mapping)


async def by_id(conn: AsyncConnection, definition_id: uuid.UUID) -> DefinitionRow | None:
    return _row(
        (await conn.execute(select(definitions).where(definitions.c.id == definition_id))).one_or_none()
    )


async def by_version(conn: AsyncConnection, process_id: str, version: int) -> DefinitionRow | None:
    """`version` 0 means the latest."""
    if not version:
        return await latest(conn, process_id)
    query = select(definitions).where(
        definitions.c.process_id == process_id, definitions.c.version == version
    )
    return _row((await conn.execute(query)).one_or_none())


async def listed(
    conn: AsyncConnection, process_id: str = "", limit: int = 100, after_key: tuple[str, int] | None = None
) -> list[DefinitionRow]:
    """Definitions by process id, newest version first, after `after_key` (process_id, version): the
    unique index on (process_id, version) yields them in this order."""
    query = select(definitions).order_by(definitions.c.process_id, definitions.c.version.desc())
    if process_id:
        query = query.where(definitions.c.process_id == process_id)
    if after_key is not None:
        after_process, after_version = after_key
        query = query.where(
            (definitions.c.process_id > after_process)
            | ((definitions.c.process_id == after_process) & (definitions.c.version < after_version))
        )
    rows = (await conn.execute(query.limit(limit))).all()
    return [typed(DefinitionRow, row._mapping) for row in rows]
