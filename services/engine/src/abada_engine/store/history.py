"""The instance history: an append-only log of what happened, in order."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import history


@dataclass(frozen=True, slots=True)
class HistoryRecord:
    instance_id: uuid.UUID
    type: str
    node_id: str | None
    task_id: uuid.UUID | None
    data: dict[str, Any]


@dataclass(slots=True)
class HistoryRow:
    id: int
    instance_id: uuid.UUID
    type: str
    node_id: str | None
    task_id: uuid.UUID | None
    data: dict[str, Any]
    created_at: datetime


async def append(conn: AsyncConnection, records: list[HistoryRecord]) -> None:
    if records:
        await conn.execute(
            insert(history),
            [
                {
                    "instance_id": r.instance_id,
                    "type": r.type,
                    "node_id": r.node_id,
                    "task_id": r.task_id,
                    "data": r.data,
                }
                for r in records
            ],
        )


async def of_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> list[HistoryRow]:
    rows = (
        await conn.execute(select(history).where(history.c.instance_id == instance_id).order_by(history.c.id))
    ).all()
    return [HistoryRow(**row._mapping) for row in rows]
