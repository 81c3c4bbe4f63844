"""The step journal's rows: appending under a live lease, finishing, reading back, and the engine's own
marks (outcome unknown, set aside, completed by a person)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.db.schema import journal_steps

from .hand_written import Executor, HandWritten, typed
from .states import StepKind, StepState, TaskState
from .tasks import LEASED_INSTANCE_VARIABLES, LeaseRow


@dataclass(slots=True)
class StepRow:
    """One journal step as stored: payloads still sealed."""

    task_id: uuid.UUID
    sequence: int
    attempt: int
    kind: str
    state: str
    tool_ref: str
    key_id: str
    aad_version: int  # which associated data the payloads were sealed with (runtime/crypto/sealing.py)
    request_ciphertext: bytes | None
    response_ciphertext: bytes | None
    request_digest: bytes | None
    response_digest: bytes | None
    input_tokens: int
    output_tokens: int
    abandoned: bool
    created_at: datetime
    updated_at: datetime


@dataclass(slots=True)
class AppendContext(LeaseRow):
    """What a careful append decides on: the lease row (checked as `read_lease`'s is), the journal's
    counts for the limits, and the step already at the requested sequence (its `taken_sequence` is
    None if the sequence is free)."""

    steps: int
    model_calls: int
    tool_calls: int
    tokens: int
    taken_sequence: int | None
    step_attempt: int | None
    kind: str | None
    step_state: str | None
    tool_ref: str | None
    key_id: str | None
    aad_version: int | None
    request_digest: bytes | None
    response_digest: bytes | None
    input_tokens: int | None
    output_tokens: int | None
    abandoned: bool | None


_STEP_COLUMNS = (
    "task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version, request_ciphertext, response_ciphertext, "
    "request_digest, response_digest, input_tokens, output_tokens, abandoned, created_at, updated_at"
)

# Hand-written: every fetch of a taken-over task and every journal read runs it.
STEPS_OF = HandWritten(
    f"SELECT {_STEP_COLUMNS} FROM journal_steps WHERE task_id = ANY(CAST(:ids AS uuid[])) ORDER BY task_id, sequence"
)

STEP_AT = HandWritten(
    f"SELECT {_STEP_COLUMNS} FROM journal_steps "
    "WHERE task_id = CAST(:id AS uuid) AND sequence = CAST(:seq AS integer)"
)

# Hand-written: one read of everything a careful append decides on, without any sealed payload.
APPEND_CONTEXT = HandWritten(
    f"""
    SELECT t.id, t.instance_id, t.node_id, t.state, t.attempt, t.retries_left, t.lease_owner, t.lease_token_hash,
           t.lease_expires_at, t.lease_expires_at > now() AS live, i.definition_id,
           {LEASED_INSTANCE_VARIABLES} AS variables, i.state AS instance_state, i.xmin::text AS instance_xmin,
           i.parent_task_id IS NOT NULL AS called, agg.steps, agg.model_calls, agg.tool_calls, agg.tokens,
           s.sequence AS taken_sequence, s.attempt AS step_attempt, s.kind, s.state AS step_state, s.tool_ref,
           s.key_id, s.aad_version, s.request_digest, s.response_digest, s.input_tokens, s.output_tokens, s.abandoned
    FROM tasks t
    JOIN instances i ON i.id = t.instance_id
    CROSS JOIN LATERAL (
        SELECT count(*) AS steps,
               count(*) FILTER (WHERE kind = '{StepKind.MODEL_CALL}' AND NOT abandoned) AS model_calls,
               count(*) FILTER (WHERE kind = '{StepKind.TOOL_CALL}' AND NOT abandoned
                                        AND state <> '{StepState.APPROVED}') AS tool_calls,
               COALESCE(sum(input_tokens + output_tokens), 0) AS tokens
        FROM journal_steps WHERE task_id = t.id
    ) agg
    LEFT JOIN journal_steps s ON s.task_id = t.id AND s.sequence = CAST(:seq AS integer)
    WHERE t.id = :id
    """
)


# The guard every step write carries: the writer still holds the task's lease, for this attempt, and
# nobody has taken the task over (a fetch changes owner, token and attempt). Finishing a step needs no
# more: a result that came back while the engine was out of reach is kept (runtime/leases.py says why).
# Beginning one (an insert of a STARTED step) needs the lease to be live as well.
# The task row is read by its primary key alone: with `state = 'LEASED'` beside the id, the planner
# would rather scan the queue's smaller partial index `tasks_fetchable` and filter on the id, a cost
# that follows the queue's open and dead entries. Reading the row first (a materialized CTE is planned
# on its own) keeps it one primary-key lookup.
def _lease_held(lock: str = "") -> str:
    return f"""
    WITH t AS MATERIALIZED (
        SELECT state, lease_owner, lease_token_hash, attempt, lease_expires_at
        FROM tasks WHERE id = CAST(:task_id AS uuid) {lock}
    )
    SELECT 1 FROM t WHERE t.state = '{TaskState.LEASED}'
      AND t.lease_owner = CAST(:worker_id AS text) AND t.lease_token_hash = CAST(:token_hash AS bytea)
      AND t.attempt = CAST(:attempt AS integer)
"""


_HELD_LEASE = _lease_held()
# Beginning a step share-locks the task row until the statement commits. A withdrawal (a deadline, a
# cancel, a takeover) updates that row first and then reads the journal for writes in flight, so a
# STARTED step either lands before that read, and is seen, or waits and finds the task withdrawn;
# without the lock it could be checked against the row as it was and land after the read, unseen. The
# lock is shared: a task's parallel calls do not wait for each other.
_LIVE_LEASE = _lease_held("FOR SHARE") + " AND t.lease_expires_at > now()"


def _insert_step_sql(gate: str) -> str:
    """Insert the step, and abandon orphaned model calls, only if the CTE `gate` has a row."""
    return f"""
    abandoned AS (
        -- A new attempt moving past a model call an earlier attempt left STARTED has re-run it.
        UPDATE journal_steps SET abandoned = true, updated_at = now()
        WHERE task_id = CAST(:task_id AS uuid) AND kind = '{StepKind.MODEL_CALL}' AND state = '{StepState.STARTED}'
          AND attempt < CAST(:attempt AS integer) AND NOT abandoned AND EXISTS (SELECT 1 FROM {gate})
    )
    INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version,
        request_ciphertext, response_ciphertext, request_digest, response_digest, input_tokens, output_tokens,
        abandoned, created_at, updated_at)
    SELECT CAST(:task_id AS uuid), CAST(:sequence AS integer), CAST(:attempt AS integer), CAST(:kind AS text),
        CAST(:state AS text), CAST(:tool_ref AS text), CAST(:key_id AS text), CAST(:aad_version AS smallint),
        CAST(:request_ct AS bytea),
        CAST(:response_ct AS bytea), CAST(:request_digest AS bytea), CAST(:response_digest AS bytea),
        CAST(:input_tokens AS bigint), CAST(:output_tokens AS bigint), false, now(), now()
    WHERE EXISTS (SELECT 1 FROM {gate})
    ON CONFLICT (task_id, sequence) DO NOTHING
    RETURNING {_STEP_COLUMNS}
    """


def _finish_step_sql(also: str = "") -> str:
    """Move a STARTED step to its final state under the caller's lease; `also` narrows which step.

    The response was sealed under the key and associated data version the caller read for the row:
    the row must still have them (`abada-engine reseal` may have sealed the row again meanwhile)."""
    return f"""
    UPDATE journal_steps SET state = CAST(:state AS text), response_ciphertext = CAST(:response_ct AS bytea),
        response_digest = CAST(:response_digest AS bytea), input_tokens = CAST(:input_tokens AS bigint),
        output_tokens = CAST(:output_tokens AS bigint), updated_at = now()
    WHERE task_id = CAST(:task_id AS uuid) AND sequence = CAST(:sequence AS integer)
      AND state = '{StepState.STARTED}' AND NOT abandoned
      AND key_id = CAST(:key_id AS text) AND aad_version = CAST(:aad_version AS smallint) {also}
      AND EXISTS ({_HELD_LEASE})
    RETURNING {_STEP_COLUMNS}
    """


# Hand-written: the careful path's writes, guarded by the lease (the caller checked the rest).
# Inserting a finished step (a read journaled once) needs the lease held; a STARTED one, live.
INSERT_GUARDED = HandWritten(f"WITH live AS ({_LIVE_LEASE}), {_insert_step_sql('live')}")
INSERT_FINISHED_GUARDED = HandWritten(f"WITH live AS ({_HELD_LEASE}), {_insert_step_sql('live')}")
FINISH_GUARDED = HandWritten(_finish_step_sql())


def _insert_checked_sql(lease: str) -> str:
    return f"""
    WITH live AS ({lease}),
    counts AS (
        SELECT count(*) AS steps,
               count(*) FILTER (WHERE kind = '{StepKind.MODEL_CALL}' AND NOT abandoned) AS model_calls,
               count(*) FILTER (WHERE kind = '{StepKind.TOOL_CALL}' AND NOT abandoned
                                        AND state <> '{StepState.APPROVED}') AS tool_calls,
               COALESCE(sum(input_tokens + output_tokens), 0) AS tokens
        FROM journal_steps WHERE task_id = CAST(:task_id AS uuid)
    ),
    allowed AS (
        SELECT 1 FROM live, counts
        WHERE counts.steps = CAST(:sequence AS integer) - 1
          AND CASE WHEN CAST(:kind AS text) = '{StepKind.MODEL_CALL}'
                   THEN counts.model_calls < CAST(:max_model_calls AS integer)
                        AND counts.tokens < CAST(:max_tokens AS bigint)
                   ELSE counts.tool_calls < CAST(:max_tool_calls AS integer) END
    ), {_insert_step_sql("allowed")}"""


# Hand-written: the direct path, one statement per step. It checks lease, attempt, the sequence being
# the next one and the node's limits itself, so nothing it relies on can be stale.
INSERT_CHECKED = HandWritten(_insert_checked_sql(_LIVE_LEASE))
INSERT_FINISHED_CHECKED = HandWritten(_insert_checked_sql(_HELD_LEASE))

# The step's own attempt must be the caller's: its response is sealed bound to it. A keyed write an
# earlier attempt started goes the careful way, which seals under the step's attempt.
FINISH_CHECKED = HandWritten(
    _finish_step_sql(
        "AND kind = CAST(:kind AS text) AND tool_ref = CAST(:tool_ref AS text) "
        "AND attempt = CAST(:attempt AS integer)"
    )
)


async def _one(statement: HandWritten, conn: Executor, params: Mapping[str, Any]) -> StepRow | None:
    row = await statement.fetchrow(conn, params)
    return typed(StepRow, row) if row is not None else None


async def append_context(conn: Executor, task_id: uuid.UUID, sequence: int) -> AppendContext | None:
    row = await APPEND_CONTEXT.fetchrow(conn, {"id": task_id, "seq": sequence})
    return typed(AppendContext, row) if row is not None else None


async def insert_guarded(
    conn: Executor, params: Mapping[str, Any], *, finished: bool = False
) -> StepRow | None:
    """Insert a step if the lease is live (held, for a `finished` one) and the sequence free; None otherwise."""
    return await _one(INSERT_FINISHED_GUARDED if finished else INSERT_GUARDED, conn, params)


async def finish_guarded(conn: Executor, params: Mapping[str, Any]) -> StepRow | None:
    """Finish a STARTED step if the caller still holds the lease; None otherwise."""
    return await _one(FINISH_GUARDED, conn, params)


async def insert_checked(
    conn: Executor, params: Mapping[str, Any], *, finished: bool = False
) -> StepRow | None:
    """Insert the next step if the lease (held, for a `finished` one), the sequence and the limits allow
    it; None otherwise."""
    return await _one(INSERT_FINISHED_CHECKED if finished else INSERT_CHECKED, conn, params)


async def finish_checked(conn: Executor, params: Mapping[str, Any]) -> StepRow | None:
    """Finish a STARTED step that is exactly the one described, under the caller's lease; None otherwise."""
    return await _one(FINISH_CHECKED, conn, params)


# The calls of one tool a task journaled: which approved call each may have used up.
TOOL_CALLS_OF = HandWritten(
    f"""
    SELECT sequence, key_id, request_digest FROM journal_steps
    WHERE task_id = CAST(:task_id AS uuid) AND kind = '{StepKind.TOOL_CALL}' AND tool_ref = :tool_ref
      AND request_digest IS NOT NULL
    ORDER BY sequence
    """
)


@dataclass(frozen=True)
class JournaledCall:
    sequence: int
    key_id: str
    request_digest: bytes


async def tool_calls_of(conn: Executor, task_id: uuid.UUID, tool_ref: str) -> list[JournaledCall]:
    rows = await TOOL_CALLS_OF.fetch(conn, {"task_id": str(task_id), "tool_ref": tool_ref})
    return [JournaledCall(r.sequence, r.key_id, bytes(r.request_digest)) for r in rows]


async def step_at(conn: Executor, task_id: uuid.UUID, sequence: int) -> StepRow | None:
    return await _one(STEP_AT, conn, {"id": task_id, "seq": sequence})


async def steps_of(conn: Executor, task_ids: list[uuid.UUID]) -> dict[uuid.UUID, list[StepRow]]:
    """The (still sealed) steps of each task, in sequence order."""
    found: dict[uuid.UUID, list[StepRow]] = {}
    if not task_ids:
        return found
    for row in await STEPS_OF.fetch(conn, {"ids": [str(i) for i in task_ids]}):
        found.setdefault(row["task_id"], []).append(typed(StepRow, row))
    return found


def _at(task_id: uuid.UUID, sequence: int) -> Any:
    return and_(journal_steps.c.task_id == task_id, journal_steps.c.sequence == sequence)


async def mark_outcome_unknown(conn: AsyncConnection, task_id: uuid.UUID, sequence: int) -> None:
    await conn.execute(
        update(journal_steps)
        .where(_at(task_id, sequence))
        .values(state=StepState.OUTCOME_UNKNOWN, updated_at=func.now())
    )


async def lock_step(conn: AsyncConnection, task_id: uuid.UUID, sequence: int) -> StepRow:
    """The step (what its payloads are sealed under), locked for the caller's transaction."""
    row = (await conn.execute(select(journal_steps).where(_at(task_id, sequence)).with_for_update())).one()
    return typed(StepRow, row._mapping)


async def complete_with_response(
    conn: AsyncConnection, task_id: uuid.UUID, sequence: int, sealed_response: bytes, digest: bytes
) -> None:
    await conn.execute(
        update(journal_steps)
        .where(_at(task_id, sequence))
        .values(
            state=StepState.COMPLETED,
            response_ciphertext=sealed_response,
            response_digest=digest,
            updated_at=func.now(),
        )
    )


async def awaiting_approval_count(conn: AsyncConnection, task_id: uuid.UUID) -> int:
    """How many tool calls of the task wait for a person's approval."""
    return (
        await conn.execute(
            select(func.count()).where(
                journal_steps.c.task_id == task_id,
                journal_steps.c.state == StepState.AWAITING_APPROVAL,
                ~journal_steps.c.abandoned,
            )
        )
    ).scalar_one()


async def decide_awaiting(
    conn: AsyncConnection,
    task_id: uuid.UUID,
    sequence: int,
    state: StepState,
    sealed_response: bytes,
    digest: bytes,
) -> bool:
    """A person decided a call awaiting approval: APPROVED (the response holds the arguments as
    approved) or COMPLETED (the response is the rejection as a tool error). False if it was not waiting."""
    result = await conn.execute(
        update(journal_steps)
        .where(_at(task_id, sequence), journal_steps.c.state == StepState.AWAITING_APPROVAL)
        .values(
            state=state, response_ciphertext=sealed_response, response_digest=digest, updated_at=func.now()
        )
    )
    return result.rowcount == 1


async def set_aside(conn: AsyncConnection, task_id: uuid.UUID, sequence: int) -> None:
    """The step no longer counts: neither replayed nor against the limits."""
    await conn.execute(
        update(journal_steps).where(_at(task_id, sequence)).values(abandoned=True, updated_at=func.now())
    )


async def set_aside_last_answer(conn: AsyncConnection, task_id: uuid.UUID) -> None:
    """Set aside the latest completed model call still counting (the answer being retried)."""
    last_answer = (
        select(func.max(journal_steps.c.sequence))
        .where(
            journal_steps.c.task_id == task_id,
            journal_steps.c.kind == StepKind.MODEL_CALL,
            journal_steps.c.state == StepState.COMPLETED,
            ~journal_steps.c.abandoned,
        )
        .scalar_subquery()
    )
    await conn.execute(
        update(journal_steps)
        .where(journal_steps.c.task_id == task_id, journal_steps.c.sequence == last_answer)
        .values(abandoned=True, updated_at=func.now())
    )


async def counts_by_kind_and_state(conn: AsyncConnection) -> dict[tuple[str, str], int]:
    rows = (
        await conn.execute(
            select(journal_steps.c.kind, journal_steps.c.state, func.count().label("n")).group_by(
                journal_steps.c.kind, journal_steps.c.state
            )
        )
    ).all()
    return {(r.kind, r.state): r.n for r in rows}
