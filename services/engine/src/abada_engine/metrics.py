"""Prometheus metrics: database-wide gauges refreshed at scrape time, per-replica RPC figures."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from abada_engine.runtime.queue_stats import QueueStats, TopicStats
from abada_engine.store.states import DependencyState

REGISTRY = CollectorRegistry(auto_describe=True)

RPC_SECONDS = Histogram(
    "abada_rpc_duration_seconds",
    "Time the engine spent answering a gRPC call.",
    ["method", "code"],
    registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
LEASE_EXPIRIES = Counter(
    "abada_lease_expiries_total", "Tasks taken over after their lease expired.", ["topic"], registry=REGISTRY
)
MODEL_CALLS_ADMITTED = Counter(
    "abada_model_calls_admitted_total",
    "Model calls this replica admitted against their profile's quotas.",
    ["model"],
    registry=REGISTRY,
)
MODEL_CALLS_REFUSED = Counter(
    "abada_model_calls_refused_total",
    "Model calls this replica refused: a full quota window (the worker waits and asks again) or max_cost_usd.",
    ["model", "reason"],
    registry=REGISTRY,
)


# The gauges of each topic's queue and the figure of its TopicStats each shows: `render` sets them all.
_TOPIC_FIGURES: list[tuple[Gauge, Callable[[TopicStats], float]]] = []


def _per_topic(name: str, documentation: str, figure: Callable[[TopicStats], float]) -> Gauge:
    gauge = Gauge(name, documentation, ["topic"], registry=REGISTRY)
    _TOPIC_FIGURES.append((gauge, figure))
    return gauge


TASKS_READY = _per_topic("abada_tasks_ready", "Tasks fetchable now, per topic.", lambda t: t.ready)
TASKS_LEASED = _per_topic("abada_tasks_leased", "Tasks under a live lease, per topic.", lambda t: t.leased)
TASKS_DEMAND = _per_topic(
    "abada_tasks_demand",
    "Tasks a topic's pool must serve now (ready + leased); KEDA scales on it.",
    lambda t: t.demand,
)
TASKS_DELAYED = _per_topic("abada_tasks_delayed", "Tasks waiting out a retry backoff.", lambda t: t.delayed)
OLDEST_READY = _per_topic(
    "abada_tasks_oldest_ready_age_seconds",
    "Age of the oldest fetchable task.",
    lambda t: t.oldest_ready_age_seconds,
)
INCIDENTS_OPEN = Gauge("abada_incidents_open", "Open incidents, per type.", ["type"], registry=REGISTRY)
JOURNAL_STEPS = Gauge(
    "abada_journal_steps", "Journal steps, per kind and state.", ["kind", "state"], registry=REGISTRY
)
MODEL_CALLS_WAITING = Gauge(
    "abada_model_calls_waiting",
    "Model calls waiting for quota now (their worker waits and asks again), per model.",
    ["model"],
    registry=REGISTRY,
)


DEPENDENCY_UP = Gauge(
    "abada_dependency_up",
    "Whether a dependency of agent tasks answers (1) or its circuit is open or probing (0).",
    ["kind", "name"],
    registry=REGISTRY,
)
DEPENDENCY_HELD_TASKS = Gauge(
    "abada_dependency_held_tasks",
    "Tasks parked until a dependency answers again.",
    ["kind", "name"],
    registry=REGISTRY,
)
RETENTION_LAG = Gauge(
    "abada_retention_lag_seconds",
    "How long the most overdue finished instance has been past its retention (0: the job keeps up).",
    registry=REGISTRY,
)
ROWS_DELETED = Counter(
    "abada_retention_rows_deleted_total",
    "Rows this replica deleted, per table, by the retention job, a purge or an erasure.",
    ["source", "table"],
    registry=REGISTRY,
)


def count_deleted(source: str, rows: dict[str, int]) -> None:
    """Add one deletion's rows (per table) to ROWS_DELETED under `source`."""
    for table, count in rows.items():
        if count:
            ROWS_DELETED.labels(source, table).inc(count)


TASKS_PARKED = _per_topic(
    "abada_tasks_parked", "Tasks parked for a dependency that is down, per topic.", lambda t: t.parked
)


def refused_total(model: str) -> int:
    """The model calls of `model` this replica refused, whatever the reason."""
    return int(
        sum(
            sample.value
            for metric in MODEL_CALLS_REFUSED.collect()
            for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels.get("model") == model
        )
    )


async def render(stats: QueueStats) -> bytes:
    """Refresh the database-wide gauges (so replicas agree) and render every metric."""
    topics = await stats.topics()
    for gauge, figure in _TOPIC_FIGURES:
        gauge.clear()
        for topic in topics:
            gauge.labels(topic.topic).set(figure(topic))
    INCIDENTS_OPEN.clear()
    for incident_type, count in (await stats.open_incidents()).items():
        INCIDENTS_OPEN.labels(incident_type).set(count)
    JOURNAL_STEPS.clear()
    for (kind, state), count in (await stats.journal_steps()).items():
        JOURNAL_STEPS.labels(kind, state).set(count)
    MODEL_CALLS_WAITING.clear()
    for model, count in (await stats.model_calls_waiting()).items():
        MODEL_CALLS_WAITING.labels(model).set(count)
    RETENTION_LAG.set(await stats.retention_lag_seconds())
    DEPENDENCY_UP.clear()
    DEPENDENCY_HELD_TASKS.clear()
    for circuit in await stats.dependencies():
        DEPENDENCY_UP.labels(circuit.kind, circuit.name).set(1 if circuit.state == DependencyState.UP else 0)
        DEPENDENCY_HELD_TASKS.labels(circuit.kind, circuit.name).set(circuit.held_tasks)
    return generate_latest(REGISTRY)


class CachedFigures:
    """`render` for scrapers: the database-wide gauges are refreshed at most once per `max_age_seconds`.

    Each refresh counts whole tables; scrapers (several Prometheus replicas, a dashboard left open) must
    not be able to make the database do that as often as they like. Concurrent scrapes share a refresh.
    """

    def __init__(self, stats: QueueStats, max_age_seconds: float) -> None:
        self._stats = stats
        self._max_age = max_age_seconds
        self._refreshed_at: float | None = None
        self._lock = asyncio.Lock()

    async def render(self) -> bytes:
        async with self._lock:
            now = time.monotonic()
            if self._refreshed_at is None or now - self._refreshed_at >= self._max_age:
                await render(self._stats)
                self._refreshed_at = time.monotonic()
        return generate_latest(REGISTRY)
