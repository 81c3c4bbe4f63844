"""Model quotas shared by every engine replica: admitting a model call, the waiting line, and the spend
a budget is checked against. (A call is settled by the database, in the transaction that journals its
finished step: migration 0004.)

Admission is the database function `abada_admit_model_calls` (migration 0004, which says why it is a
function): a batch of one model's calls in one round trip under one acquisition of the model's lock,
correct across replicas and restarts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import journal_steps, model_quota_usage, model_quota_waiters, tasks

from .hand_written import Executor, HandWritten
from .states import StepKind

_ADMIT = HandWritten(
    """
    SELECT call_index, admitted, retry_after_ms, reason, waiting_ahead FROM abada_admit_model_calls(
        CAST(:model AS text), CAST(:task_ids AS uuid[]), CAST(:sequences AS integer[]),
        CAST(:attempts AS integer[]), CAST(:tokens AS bigint[]),
        CAST(:requests_per_minute AS integer), CAST(:tokens_per_minute AS bigint),
        CAST(:max_concurrent AS integer), CAST(:span_seconds AS integer))
    """
)

# Releases (as settlements) write corrections to a counter row of their own (slot 1-8, by server
# process; migration 0004 says why), never to the admissions' row. Without waiting for the WAL flush
# (as admission): a PostgreSQL crash may forget the last releases, and the windows then count those
# calls, once.
_ASYNC_COMMIT = "cfg AS (SELECT set_config('synchronous_commit', 'off', true) AS setting)"
_CORRECTION_SLOT = "CAST(1 + pg_backend_pid() % 8 AS smallint)"

# An admitted call the journal then refused never reached the provider: give its place back.
_RELEASE = HandWritten(
    f"""
    WITH {_ASYNC_COMMIT}, done AS (
        DELETE FROM model_quota_calls WHERE task_id = CAST(:task_id AS uuid) AND sequence = CAST(:sequence AS integer)
            AND attempt = CAST(:attempt AS integer)
        RETURNING model, second, estimated_tokens
    )
    INSERT INTO model_quota_usage AS u (model, second, slot, requests, tokens)
    SELECT done.model, done.second, {_CORRECTION_SLOT}, -1, -done.estimated_tokens
    FROM done, cfg WHERE cfg.setting = 'off'
    ON CONFLICT (model, second, slot) DO UPDATE SET requests = u.requests + EXCLUDED.requests,
        tokens = u.tokens + EXCLUDED.tokens
    """
)


# The reason of an admission that found the call admitted already (a re-sent STARTED; migration 0007).
ALREADY_ADMITTED = "already_admitted"


@dataclass(frozen=True, slots=True)
class Admission:
    admitted: bool
    retry_after_ms: int
    # Which window is full: requests_per_minute, tokens_per_minute or max_concurrent_calls.
    reason: str
    # Live waiters that arrived before this call and go first.
    waiting_ahead: int


@dataclass(frozen=True, slots=True)
class Quota:
    """A model profile's windows, as admission checks them (None: no such limit)."""

    model: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    # How far back a window counts (a minute plus the engine's margin).
    span_seconds: int


@dataclass(frozen=True, slots=True)
class ModelCall:
    """A model call asking to be admitted at its STARTED step, with its estimated tokens."""

    task_id: uuid.UUID
    sequence: int
    attempt: int
    tokens: int


async def admit(conn: Executor, quota: Quota, calls: Sequence[ModelCall]) -> list[Admission]:
    """Admits or refuses each call of one model, deciding them in the order given; one answer per call."""
    rows = await _ADMIT.fetch(
        conn,
        {
            "model": quota.model,
            "task_ids": [call.task_id for call in calls],
            "sequences": [call.sequence for call in calls],
            "attempts": [call.attempt for call in calls],
            "tokens": [call.tokens for call in calls],
            "requests_per_minute": quota.requests_per_minute,
            "tokens_per_minute": quota.tokens_per_minute,
            "max_concurrent": quota.max_concurrent,
            "span_seconds": quota.span_seconds,
        },
    )
    answers: list[Admission | None] = [None] * len(calls)
    for row in rows:
        answers[row.call_index - 1] = Admission(
            bool(row.admitted), int(row.retry_after_ms), str(row.reason), int(row.waiting_ahead)
        )
    assert all(answer is not None for answer in answers)  # the function answers every call
    return answers  # type: ignore[return-value]


async def release(conn: Executor, task_id: uuid.UUID, sequence: int, attempt: int) -> None:
    await _RELEASE.fetch(conn, {"task_id": task_id, "sequence": sequence, "attempt": attempt})


@dataclass(frozen=True, slots=True)
class ModelUsage:
    model: str
    admitted: int
    tokens: int


async def usage_by_model(conn: AsyncConnection, span_seconds: int) -> list[ModelUsage]:
    """Per model: the calls admitted and the tokens counted in the current window."""
    window_start = func.floor(func.extract("epoch", func.now())) - span_seconds
    rows = (
        await conn.execute(
            select(
                model_quota_usage.c.model,
                func.sum(model_quota_usage.c.requests).label("admitted"),
                func.sum(model_quota_usage.c.tokens).label("tokens"),
            )
            .where(model_quota_usage.c.second > window_start)
            .group_by(model_quota_usage.c.model)
        )
    ).all()
    return [ModelUsage(r.model, int(r.admitted), int(r.tokens)) for r in rows]


async def waiting_by_model(conn: AsyncConnection) -> dict[str, int]:
    """Model calls waiting for quota now (their worker asked again within its grace), per model."""
    rows = (
        await conn.execute(
            select(model_quota_waiters.c.model, func.count().label("n"))
            .where(model_quota_waiters.c.expires_at > func.now())
            .group_by(model_quota_waiters.c.model)
        )
    ).all()
    return {r.model: r.n for r in rows}


async def waiting_tasks_by_topic(conn: AsyncConnection) -> dict[str, int]:
    """Leased tasks whose model call is waiting for quota now, per topic."""
    rows = (
        await conn.execute(
            select(tasks.c.topic, func.count(func.distinct(tasks.c.id)).label("n"))
            .select_from(model_quota_waiters.join(tasks, tasks.c.id == model_quota_waiters.c.task_id))
            .where(model_quota_waiters.c.expires_at > func.now())
            .group_by(tasks.c.topic)
        )
    ).all()
    return {r.topic: r.n for r in rows}


@dataclass(frozen=True, slots=True)
class NodeTokens:
    """Model-call tokens journaled by the tasks of one node of an instance."""

    node_id: str
    this_task: bool
    input_tokens: int
    output_tokens: int


async def model_tokens_of_instance(conn: AsyncConnection, task_id: uuid.UUID) -> list[NodeTokens]:
    """Per node of the task's instance (and apart for the task itself): the model calls' journaled tokens,
    abandoned calls included (they were paid for)."""
    instance_of_task = select(tasks.c.instance_id).where(tasks.c.id == task_id).scalar_subquery()
    this_task = (tasks.c.id == task_id).label("this_task")
    rows = (
        await conn.execute(
            select(
                tasks.c.node_id,
                this_task,
                func.coalesce(func.sum(journal_steps.c.input_tokens), 0).label("input_tokens"),
                func.coalesce(func.sum(journal_steps.c.output_tokens), 0).label("output_tokens"),
            )
            .select_from(journal_steps.join(tasks, tasks.c.id == journal_steps.c.task_id))
            .where(tasks.c.instance_id == instance_of_task, journal_steps.c.kind == StepKind.MODEL_CALL)
            .group_by(tasks.c.node_id, this_task)
        )
    ).all()
    return [NodeTokens(r.node_id, bool(r.this_task), int(r.input_tokens), int(r.output_tokens)) for r in rows]
