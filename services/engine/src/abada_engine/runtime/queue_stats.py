"""Queue depth and other operator figures, read from the database so every replica agrees."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.runtime.quota.window import QUOTA_SPAN_SECONDS
from abada_engine.store import dependencies as circuit_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import journal_steps as step_store
from abada_engine.store import model_quotas as quota_store
from abada_engine.store import retention as retention_store
from abada_engine.store import tasks as task_store
from abada_engine.store.dependencies import ListedCircuit
from abada_engine.store.states import TaskState

MAX_LISTED_TASKS = 1000


@dataclass(frozen=True)
class TopicStats:
    topic: str
    ready: int  # fetchable now: due, and not under a live lease (an expired lease counts)
    leased: int  # under a live lease
    delayed: int  # waiting out a retry backoff
    oldest_ready_age_seconds: float
    # Leased tasks whose model call is waiting for its quota: part of `leased`, but not of `demand`.
    quota_waiting: int = 0
    # Parked until a dependency they need answers again: neither ready nor leased, so not demand
    # either (more pods cannot make a provider that is down answer sooner).
    parked: int = 0

    @property
    def demand(self) -> int:
        """The tasks the pool must serve now: the ones waiting for a worker and the ones being worked on,
        less those only waiting for model quota.

        Autoscalers scale on this, not on `ready` alone: a burst being worked on with nothing left
        waiting must keep its pods, or they are stopped in the middle of long agent tasks. Tasks
        waiting for quota are counted apart: more pods cannot make a quota-bound model answer sooner.
        """
        return self.ready + self.leased - min(self.quota_waiting, self.leased)

    def to_json(self) -> dict[str, object]:
        return {
            "topic": self.topic,
            "ready": self.ready,
            "leased": self.leased,
            "delayed": self.delayed,
            "demand": self.demand,
            "quotaWaiting": self.quota_waiting,
            "parked": self.parked,
            "oldestReadyAgeSeconds": round(self.oldest_ready_age_seconds, 3),
        }


@dataclass(frozen=True)
class QueuedTask:
    """An unfinished external task, with where it stands in the queue in one word."""

    row: task_store.QueuedTaskRow

    @property
    def standing(self) -> str:
        """READY, DELAYED (in a retry backoff), LEASED, EXPIRED (lease ran out, fetchable), PARKED (for
        a dependency that is down) or INCIDENT."""
        row = self.row
        due = row.due_at is None or row.due_at <= row.now
        if row.state == TaskState.LEASED:
            return "EXPIRED" if due else "LEASED"
        if row.state == TaskState.READY:
            return "READY" if due else "DELAYED"
        return str(row.state)


@dataclass(frozen=True)
class ModelStats:
    name: str
    admitted: int  # in the current window
    tokens: int  # counted in the current window (estimates until the calls complete)
    waiting: int  # waiting for quota now


class QueueStats:
    def __init__(self, engine: AsyncEngine) -> None:
        self._reads = autocommit(engine)

    async def topic(self, topic: str) -> TopicStats:
        async with self._reads.connect() as conn:
            rows = await task_store.topic_counts(conn, topic)
            waiting = await quota_store.waiting_tasks_by_topic(conn) if rows else {}
        if not rows:
            return TopicStats(topic, 0, 0, 0, 0.0)
        return _stats(rows[0], waiting)

    async def topics(self) -> list[TopicStats]:
        async with self._reads.connect() as conn:
            rows = await task_store.topic_counts(conn)
            waiting = await quota_store.waiting_tasks_by_topic(conn)
        return [_stats(r, waiting) for r in rows]

    async def model_calls_waiting(self) -> dict[str, int]:
        async with self._reads.connect() as conn:
            return await quota_store.waiting_by_model(conn)

    async def models(self) -> list[ModelStats]:
        """Every model with calls in its current window or waiting for it."""
        async with self._reads.connect() as conn:
            usage = {u.model: u for u in await quota_store.usage_by_model(conn, QUOTA_SPAN_SECONDS)}
            waiting = await quota_store.waiting_by_model(conn)
        return [
            ModelStats(
                name,
                usage[name].admitted if name in usage else 0,
                usage[name].tokens if name in usage else 0,
                waiting.get(name, 0),
            )
            for name in sorted(set(usage) | set(waiting))
        ]

    async def open_tasks(
        self,
        topic: str | None = None,
        instance_id: uuid.UUID | None = None,
        limit: int = 100,
        after_key: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[QueuedTask]:
        async with self._reads.connect() as conn:
            rows = await task_store.open_external_tasks(
                conn, topic, instance_id, min(limit, MAX_LISTED_TASKS + 1), after_key
            )
        return [QueuedTask(row) for row in rows]

    async def open_incidents(self) -> dict[str, int]:
        async with self._reads.connect() as conn:
            return await incident_store.open_counts_by_type(conn)

    async def dependencies(self) -> list[ListedCircuit]:
        async with self._reads.connect() as conn:
            return await circuit_store.listed(conn)

    async def retention_lag_seconds(self) -> float:
        async with self._reads.connect() as conn:
            return await retention_store.retention_lag_seconds(conn)

    async def journal_steps(self) -> dict[tuple[str, str], int]:
        async with self._reads.connect() as conn:
            return await step_store.counts_by_kind_and_state(conn)


def _stats(counts: task_store.TopicCounts, quota_waiting: dict[str, int]) -> TopicStats:
    return TopicStats(
        counts.topic,
        counts.ready,
        counts.leased,
        counts.delayed,
        counts.oldest,
        quota_waiting.get(counts.topic, 0),
        counts.parked,
    )
