"""Published messages and the receives waiting for them: one function per step of correlating."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import messages

from .hand_written import typed
from .states import InstanceState, TaskKind, TaskState

# Every transaction that creates a receive says so here, so a replica looks for a buffered message.
RECEIVE_CHANNEL = "abada_receives"


@dataclass(slots=True)
class MessageRow:
    id: uuid.UUID
    name: str
    correlation_key: str
    variables: dict[str, Any]
    message_id: str | None
    created_at: datetime
    expires_at: datetime
    correlated_instance_id: uuid.UUID | None
    correlated_at: datetime | None


@dataclass(slots=True)
class WaitingReceive:
    task_id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    definition_id: uuid.UUID
    variables: dict[str, Any]


async def hold_message_id(conn: AsyncConnection, name: str, message_id: str) -> None:
    """Serialise publications of one message id until the caller's transaction ends, so a re-sent
    webhook racing the first publication waits for it and is answered with it."""
    await conn.execute(
        text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 23))"),
        {"key": f"{len(name)}:{name}/{message_id}"},
    )


async def live_by_message_id(conn: AsyncConnection, name: str, message_id: str) -> MessageRow | None:
    """The publication of `message_id` still within its ttl, if any."""
    row = (
        await conn.execute(
            select(messages)
            .where(
                messages.c.name == name,
                messages.c.message_id == message_id,
                messages.c.expires_at > func.now(),
            )
            .order_by(messages.c.created_at)
            .limit(1)
        )
    ).first()
    return typed(MessageRow, row._mapping) if row is not None else None


# The oldest receive of this name and key still waiting, locked; one another transaction is
# correlating is skipped (the next one gets the message, or it is buffered and picked up after).
_OLDEST_RECEIVE = text(
    f"""
    SELECT k.id AS task_id, k.instance_id, k.node_id, i.definition_id, i.variables
    FROM tasks k JOIN instances i ON i.id = k.instance_id
    WHERE k.kind = '{TaskKind.RECEIVE}' AND k.state = '{TaskState.WAITING}'
      AND k.payload ->> 'message' = :name AND k.payload ->> 'correlation_key' = :key
      AND i.state = '{InstanceState.ACTIVE}'
    ORDER BY k.created_at
    LIMIT 1
    FOR UPDATE OF k SKIP LOCKED
    """
)


async def lock_oldest_receive(conn: AsyncConnection, name: str, key: str) -> WaitingReceive | None:
    row = (await conn.execute(_OLDEST_RECEIVE, {"name": name, "key": key})).first()
    return typed(WaitingReceive, row._mapping) if row is not None else None


@dataclass(frozen=True, slots=True)
class NewMessage:
    id: uuid.UUID
    name: str
    correlation_key: str
    variables: dict[str, Any]
    message_id: str | None
    published_by: str
    ttl_seconds: float
    correlated_instance_id: uuid.UUID | None


async def insert_message(conn: AsyncConnection, message: NewMessage) -> MessageRow:
    """Write a publication: correlated already, or buffered for its ttl."""
    row = (
        await conn.execute(
            insert(messages)
            .values(
                id=message.id,
                name=message.name,
                correlation_key=message.correlation_key,
                variables=message.variables,
                message_id=message.message_id,
                published_by=message.published_by,
                created_at=func.now(),
                expires_at=func.now() + func.make_interval(0, 0, 0, 0, 0, 0, message.ttl_seconds),
                correlated_instance_id=message.correlated_instance_id,
                correlated_at=func.now() if message.correlated_instance_id else None,
            )
            .returning(*messages.c)
        )
    ).one()
    return typed(MessageRow, row._mapping)


# Buffered messages within their ttl that a waiting receive matches, oldest first, locked (SKIP
# LOCKED: replicas share them).
_MATCHABLE = text(
    f"""
    SELECT m.* FROM messages m
    WHERE m.correlated_at IS NULL AND m.expires_at > now()
      AND EXISTS (SELECT 1 FROM tasks k
                  WHERE k.kind = '{TaskKind.RECEIVE}' AND k.state = '{TaskState.WAITING}'
                    AND k.payload ->> 'message' = m.name AND k.payload ->> 'correlation_key' = m.correlation_key)
    ORDER BY m.created_at
    LIMIT :limit
    FOR UPDATE OF m SKIP LOCKED
    """
)


async def lock_matchable(conn: AsyncConnection, limit: int) -> list[MessageRow]:
    rows = await conn.execute(_MATCHABLE, {"limit": limit})
    return [typed(MessageRow, r._mapping) for r in rows.all()]


async def mark_correlated(conn: AsyncConnection, message_id: uuid.UUID, instance_id: uuid.UUID) -> None:
    await conn.execute(
        update(messages)
        .where(messages.c.id == message_id)
        .values(correlated_instance_id=instance_id, correlated_at=func.now())
    )


async def delete_expired(conn: AsyncConnection, limit: int = 1000) -> int:
    """Publications past their ttl are gone: neither correlated any more nor remembered for their id."""
    expired = select(messages.c.id).where(messages.c.expires_at <= func.now()).limit(limit).scalar_subquery()
    result = await conn.execute(delete(messages).where(messages.c.id.in_(expired)))
    return result.rowcount


async def of_instance(conn: AsyncConnection, instance_id: uuid.UUID) -> list[MessageRow]:
    """The messages correlated to an instance, in order."""
    rows = await conn.execute(
        select(messages)
        .where(messages.c.correlated_instance_id == instance_id)
        .order_by(messages.c.correlated_at)
    )
    return [typed(MessageRow, r._mapping) for r in rows.all()]
