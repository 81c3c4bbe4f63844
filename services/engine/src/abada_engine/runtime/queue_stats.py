"""Queue depth and other operator figures, read from the database so every replica agrees."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit


@dataclass(frozen=True)
class TopicStats:
    topic: str
    ready: int  # fetchable now: due, and not under a live lease (an expired lease counts)
    leased: int  # under a live lease
    delayed: int  # waiting out a retry backoff
    oldest_ready_age_seconds: float

    def to_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "ready": self.ready,
            "leased": self.leased,
            "delayed": self.delayed,
            "oldestReadyAgeSeconds": round(self.oldest_ready_age_seconds, 3),
        }


_STATS_SQL = """
    SELECT topic,
           count(*) FILTER (WHERE due_at <= now()) AS ready,
           count(*) FILTER (WHERE state = 'LEASED' AND due_at > now()) AS leased,
           count(*) FILTER (WHERE state = 'READY' AND due_at > now()) AS delayed,
           COALESCE(EXTRACT(EPOCH FROM now() - min(due_at) FILTER (WHERE due_at <= now())), 0) AS oldest
    FROM tasks
    WHERE state IN ('READY', 'LEASED') {where}
    GROUP BY topic
"""


class QueueStats:
    def __init__(self, engine: AsyncEngine) -> None:
        self._reads = autocommit(engine)

    async def topic(self, topic: str) -> TopicStats:
        async with self._reads.connect() as conn:
            row = (
                await conn.execute(text(_STATS_SQL.format(where="AND topic = :topic")), {"topic": topic})
            ).first()
        if row is None:
            return TopicStats(topic, 0, 0, 0, 0.0)
        return TopicStats(topic, row.ready, row.leased, row.delayed, float(row.oldest))

    async def topics(self) -> list[TopicStats]:
        async with self._reads.connect() as conn:
            rows = (await conn.execute(text(_STATS_SQL.format(where="AND topic IS NOT NULL")))).all()
        return [TopicStats(r.topic, r.ready, r.leased, r.delayed, float(r.oldest)) for r in rows]

    async def open_incidents(self) -> dict[str, int]:
        async with self._reads.connect() as conn:
            rows = (
                await conn.execute(
                    text("SELECT type, count(*) AS n FROM incidents WHERE state = 'OPEN' GROUP BY type")
                )
            ).all()
        return {r.type: r.n for r in rows}

    async def journal_steps(self) -> dict[tuple[str, str], int]:
        async with self._reads.connect() as conn:
            rows = (
                await conn.execute(
                    text("SELECT kind, state, count(*) AS n FROM journal_steps GROUP BY kind, state")
                )
            ).all()
        return {(r.kind, r.state): r.n for r in rows}
