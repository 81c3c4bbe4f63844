"""The step journal: what a worker did under a lease, step by step, sealed at rest.

Every model and tool call is journaled; the engine checks the lease, the attempt,
the sequence, the binding and the limits before a step is accepted, so a worker that
takes over after a crash can replay finished steps instead of paying for them again,
and a write is never re-sent blindly.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit, dumps
from abada_engine.db.raw import RawSql
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.definitions.model import ToolBinding
from abada_engine.errors import Category, EngineError, invalid, not_found

from .crypto import IdempotencyKeys, JournalIntegrityError, KeyRing
from .leases import hash_token, held_from_row
from .navigator import HistoryEntry
from .tokens import TASK_CHANNEL, history_row, raise_incident, write_history
from .views import LockedTask, StepView

KINDS = ("MODEL_CALL", "TOOL_CALL")
WORKER_STATES = ("STARTED", "COMPLETED", "FAILED")
FINISHED = ("COMPLETED", "FAILED")
MAX_PAYLOAD_BYTES = 1_000_000


@dataclass(frozen=True)
class StepRequest:
    task_id: uuid.UUID
    worker_id: str
    lease_token: str
    attempt: int
    sequence: int
    kind: str
    state: str
    tool_ref: str
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class AppendResult:
    step: StepView
    idempotency_key: str


_STEPS_SQL = RawSql(
    """
    SELECT task_id, sequence, attempt, kind, state, tool_ref, key_id, request_ciphertext, response_ciphertext,
           request_digest, response_digest, input_tokens, output_tokens, abandoned, created_at, updated_at
    FROM journal_steps WHERE task_id = ANY(CAST(:ids AS uuid[])) ORDER BY task_id, sequence
    """
)


_STEP_SQL = RawSql(
    "SELECT * FROM journal_steps WHERE task_id = CAST(:id AS uuid) AND sequence = CAST(:seq AS integer)"
)

# The lease row, the journal's counts for the limits, and the step already at the sequence (if any),
# without any sealed payload: what `append` decides on.
_APPEND_READ_SQL = RawSql(
    """
    SELECT t.id, t.instance_id, t.node_id, t.state, t.attempt, t.retries_left, t.lease_owner, t.lease_token_hash,
           t.lease_expires_at, t.lease_expires_at > now() AS live, i.definition_id, i.variables,
           i.state AS instance_state,
           agg.steps, agg.model_calls, agg.tool_calls, agg.tokens,
           s.sequence AS taken_sequence, s.attempt AS step_attempt, s.kind, s.state AS step_state, s.tool_ref,
           s.key_id, s.request_digest, s.response_digest, s.input_tokens, s.output_tokens, s.abandoned
    FROM tasks t
    JOIN instances i ON i.id = t.instance_id
    CROSS JOIN LATERAL (
        SELECT count(*) AS steps,
               count(*) FILTER (WHERE kind = 'MODEL_CALL' AND NOT abandoned) AS model_calls,
               count(*) FILTER (WHERE kind = 'TOOL_CALL' AND NOT abandoned) AS tool_calls,
               COALESCE(sum(input_tokens + output_tokens), 0) AS tokens
        FROM journal_steps WHERE task_id = t.id
    ) agg
    LEFT JOIN journal_steps s ON s.task_id = t.id AND s.sequence = CAST(:seq AS integer)
    WHERE t.id = :id
    """
)

_LIVE_LEASE = """
    SELECT 1 FROM tasks WHERE id = CAST(:task_id AS uuid) AND state = 'LEASED'
      AND lease_owner = CAST(:worker_id AS text) AND lease_token_hash = CAST(:token_hash AS bytea)
      AND lease_expires_at > now() AND attempt = CAST(:attempt AS integer)
"""


def _insert_step_sql(gate: str) -> str:
    """Insert the step, and abandon orphaned model calls, only if the CTE `gate` has a row."""
    return f"""
    abandoned AS (
        -- A new attempt moving past a model call an earlier attempt left STARTED has re-run it.
        UPDATE journal_steps SET abandoned = true, updated_at = now()
        WHERE task_id = CAST(:task_id AS uuid) AND kind = 'MODEL_CALL' AND state = 'STARTED'
          AND attempt < CAST(:attempt AS integer) AND NOT abandoned AND EXISTS (SELECT 1 FROM {gate})
    )
    INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, request_ciphertext,
        response_ciphertext, request_digest, response_digest, input_tokens, output_tokens, abandoned,
        created_at, updated_at)
    SELECT CAST(:task_id AS uuid), CAST(:sequence AS integer), CAST(:attempt AS integer), CAST(:kind AS text),
        CAST(:state AS text), CAST(:tool_ref AS text), CAST(:key_id AS text), CAST(:request_ct AS bytea),
        CAST(:response_ct AS bytea), CAST(:request_digest AS bytea), CAST(:response_digest AS bytea),
        CAST(:input_tokens AS bigint), CAST(:output_tokens AS bigint), false, now(), now()
    WHERE EXISTS (SELECT 1 FROM {gate})
    ON CONFLICT (task_id, sequence) DO NOTHING
    RETURNING *
    """


def _finish_step_sql(also: str = "") -> str:
    """Move a STARTED step to its final state under the live lease; `also` narrows which step."""
    return f"""
    UPDATE journal_steps SET state = CAST(:state AS text), response_ciphertext = CAST(:response_ct AS bytea),
        response_digest = CAST(:response_digest AS bytea), input_tokens = CAST(:input_tokens AS bigint),
        output_tokens = CAST(:output_tokens AS bigint), updated_at = now()
    WHERE task_id = CAST(:task_id AS uuid) AND sequence = CAST(:sequence AS integer) AND state = 'STARTED'
      AND NOT abandoned {also}
      AND EXISTS ({_LIVE_LEASE})
    RETURNING *
    """


_APPEND_INSERT_SQL = RawSql(f"WITH live AS ({_LIVE_LEASE}), {_insert_step_sql('live')}")
_APPEND_FINISH_SQL = RawSql(_finish_step_sql())


_EXPIRED_WITH_WRITES_SQL = text(
    """
    SELECT t.id, t.instance_id, t.node_id, i.definition_id
    FROM tasks t JOIN instances i ON i.id = t.instance_id
    WHERE t.state = 'LEASED' AND t.due_at <= now() AND t.topic = 'abada:agent'
      AND EXISTS (SELECT 1 FROM journal_steps j WHERE j.task_id = t.id AND j.kind = 'TOOL_CALL'
                  AND j.state = 'STARTED' AND NOT j.abandoned)
    ORDER BY t.due_at
    LIMIT :limit
    FOR UPDATE OF t SKIP LOCKED
    """
)


_PLACEMENTS_KEPT = 100_000

# The direct path: the statement itself checks lease, attempt, the sequence being the next one and
# the node's limits, so nothing it relies on can be stale.
_FAST_INSERT_SQL = RawSql(
    f"""
    WITH live AS ({_LIVE_LEASE}),
    counts AS (
        SELECT count(*) AS steps,
               count(*) FILTER (WHERE kind = 'MODEL_CALL' AND NOT abandoned) AS model_calls,
               count(*) FILTER (WHERE kind = 'TOOL_CALL' AND NOT abandoned) AS tool_calls,
               COALESCE(sum(input_tokens + output_tokens), 0) AS tokens
        FROM journal_steps WHERE task_id = CAST(:task_id AS uuid)
    ),
    allowed AS (
        SELECT 1 FROM live, counts
        WHERE counts.steps = CAST(:sequence AS integer) - 1
          AND CASE WHEN CAST(:kind AS text) = 'MODEL_CALL'
                   THEN counts.model_calls < CAST(:max_model_calls AS integer)
                        AND counts.tokens < CAST(:max_tokens AS bigint)
                   ELSE counts.tool_calls < CAST(:max_tool_calls AS integer) END
    ), {_insert_step_sql("allowed")}"""
)

_FAST_FINISH_SQL = RawSql(
    _finish_step_sql(
        "AND kind = CAST(:kind AS text) AND tool_ref = CAST(:tool_ref AS text) AND key_id = CAST(:key_id AS text) "
        "AND (attempt = CAST(:attempt AS integer) OR CAST(:keyed AS boolean))"
    )
)


class Journal:
    def __init__(
        self, engine: AsyncEngine, catalog: DefinitionCatalog, keys: KeyRing, idempotency: IdempotencyKeys
    ) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._keys = keys
        self._idempotency = idempotency
        # task -> (definition, node): where the task stands, so most appends need no read first.
        self._placements: OrderedDict[uuid.UUID, tuple[uuid.UUID, str]] = OrderedDict()

    async def append(self, step: StepRequest) -> AppendResult:
        """Check and journal one step.

        The common case is one statement that checks the lease, the sequence and the limits itself
        and writes the step; it needs only to know which node the task is at (remembered from the
        lock or an earlier step, never trusted for anything the statement does not re-check).
        Anything else (a re-send, a conflict, a refusal to explain) takes the careful path.
        """
        _check_shape(step)
        placed = self._placements.get(step.task_id)
        if placed is not None:
            direct = await self._append_directly(step, *placed)
            if direct is not None:
                return direct
        return await self._append_checked(step)

    def remember_placement(self, task_id: uuid.UUID, definition_id: uuid.UUID, node_id: str) -> None:
        self._placements[task_id] = (definition_id, node_id)
        self._placements.move_to_end(task_id)
        if len(self._placements) > _PLACEMENTS_KEPT:
            self._placements.popitem(last=False)

    async def _append_directly(
        self, step: StepRequest, definition_id: uuid.UUID, node_id: str
    ) -> AppendResult | None:
        definition = await self._catalog.get(definition_id)
        node = definition.process.node(node_id)
        bindings = {b.ref: b for b in definition.bindings_for(node.id)}
        # A step this node may not journal goes the careful way, which says why.
        if step.kind == "TOOL_CALL":
            binding = bindings.get(step.tool_ref)
            if binding is None:
                return None
        else:
            binding = None
            if step.tool_ref:
                return None
        guard = {
            "task_id": step.task_id,
            "worker_id": step.worker_id,
            "token_hash": hash_token(step.lease_token),
            "attempt": step.attempt,
        }
        key_id = self._keys.primary
        starts_first = step.kind == "MODEL_CALL" or (binding is not None and binding.policy == "write")
        async with self._reads.connect() as conn:
            if step.state in FINISHED and starts_first:
                if step.request is not None:
                    return None  # the request must be compared with the STARTED one: the careful path
                keyed = binding is not None and binding.idempotency == "key"
                row = await _FAST_FINISH_SQL.fetchrow(
                    conn, {**self._write_params(step, guard, key_id, with_request=False), "keyed": keyed}
                )
                if row is None:
                    return None
                return AppendResult(self._view(row, response=step.response), self._key_for(row, binding))
            row = await _FAST_INSERT_SQL.fetchrow(
                conn,
                {
                    **self._write_params(step, guard, key_id),
                    "max_model_calls": node.limits.max_model_calls,
                    "max_tool_calls": node.limits.max_tool_calls,
                    "max_tokens": node.limits.max_tokens,
                },
            )
        if row is None:
            return None
        return AppendResult(self._view(row, step.request, step.response), self._key_for(row, binding))

    async def _append_checked(self, step: StepRequest) -> AppendResult:
        """One read of everything `append` decides on, then one write guarded by the lease.

        The sequence's primary key settles races: the loser re-reads and is answered as a re-send
        (identical step) or refused (SEQUENCE_CONFLICT).
        """
        for _ in range(3):
            async with self._reads.connect() as conn:
                row = await _APPEND_READ_SQL.fetchrow(conn, {"id": step.task_id, "seq": step.sequence})
                held = held_from_row(row, step.task_id, step.worker_id, step.lease_token)
                if step.attempt != held.attempt:
                    raise EngineError(
                        Category.FAILED_PRECONDITION,
                        "ATTEMPT_MISMATCH",
                        f"the lease is for attempt {held.attempt}, not {step.attempt}",
                        field="attempt",
                    )
                self.remember_placement(step.task_id, held.definition_id, held.node_id)
                definition = await self._catalog.get(held.definition_id)
                node = definition.process.node(held.node_id)
                bindings = {b.ref: b for b in definition.bindings_for(node.id)}
                guard = {
                    "task_id": step.task_id,
                    "worker_id": step.worker_id,
                    "token_hash": hash_token(step.lease_token),
                    "attempt": step.attempt,
                }
                if row.taken_sequence is not None:
                    result = await self._revisit(conn, step, row, bindings, guard)
                else:
                    result = await self._insert(conn, step, row, node, bindings, guard)
            if result is not None:
                return result
        raise EngineError(
            Category.ABORTED, "CONCURRENT_CHANGE", f"task {step.task_id} kept changing; try again"
        )

    async def _insert(
        self,
        conn: AsyncConnection,
        step: StepRequest,
        row: Any,
        node: Any,
        bindings: dict[str, ToolBinding],
        guard: dict[str, Any],
    ) -> AppendResult | None:
        next_free = row.steps + 1
        if step.sequence != next_free:
            raise EngineError(
                Category.FAILED_PRECONDITION,
                "SEQUENCE_GAP",
                f"the next sequence of task {step.task_id} is {next_free}, not {step.sequence}",
                field="sequence",
            )
        binding = _binding_for(step, bindings)
        _check_limits(step, row, node.limits)
        key_id = self._keys.primary
        inserted = await _APPEND_INSERT_SQL.fetchrow(conn, self._write_params(step, guard, key_id))
        if inserted is None:
            return None  # the lease or the sequence changed under us: read again
        return AppendResult(
            self._view(inserted, step.request, step.response), self._key_for(inserted, binding)
        )

    async def _revisit(
        self,
        conn: AsyncConnection,
        step: StepRequest,
        taken: Any,
        bindings: dict[str, ToolBinding],
        guard: dict[str, Any],
    ) -> AppendResult | None:
        """A step at a taken sequence: the same step again, a STARTED step finishing, or a conflict."""
        binding = bindings.get(taken.tool_ref)
        same_request = step.request is None or self._keys.digest(taken.key_id, step.request) == bytes(
            taken.request_digest or b""
        )
        same_response = (step.response is None and taken.response_digest is None) or (
            step.response is not None
            and taken.response_digest is not None
            and self._keys.digest(taken.key_id, step.response) == bytes(taken.response_digest)
        )
        if (
            (taken.kind, taken.step_state, taken.tool_ref) == (step.kind, step.state, step.tool_ref)
            and same_request
            and same_response
            and (taken.input_tokens, taken.output_tokens) == (step.input_tokens, step.output_tokens)
        ):
            full = await _STEP_SQL.fetchrow(conn, {"id": step.task_id, "seq": step.sequence})
            return AppendResult(self._view(full), self._key_for(full, binding))
        finishing = (
            taken.step_state == "STARTED"
            and step.state in FINISHED
            and (taken.kind, taken.tool_ref) == (step.kind, step.tool_ref)
            and same_request
            and not taken.abandoned
            # A later attempt may only finish a write it re-sent under the same key.
            and (taken.step_attempt == step.attempt or (binding is not None and binding.idempotency == "key"))
        )
        if not finishing:
            raise EngineError(
                Category.ABORTED,
                "SEQUENCE_CONFLICT",
                f"sequence {step.sequence} of task {step.task_id} already holds a different step "
                f"({taken.kind} {taken.step_state}{' ' + taken.tool_ref if taken.tool_ref else ''})",
                field="sequence",
            )
        finished = await _APPEND_FINISH_SQL.fetchrow(
            conn, self._write_params(step, guard, taken.key_id, with_request=False)
        )
        if finished is None:
            return None
        return AppendResult(self._view(finished, response=step.response), self._key_for(finished, binding))

    async def steps(self, task_ids: list[uuid.UUID]) -> dict[uuid.UUID, list[Any]]:
        """The raw (still sealed) journal rows of each task, in sequence order."""
        if not task_ids:
            return {}
        async with self._reads.connect() as conn:
            rows = await _STEPS_SQL.fetch(conn, {"ids": [str(i) for i in task_ids]})
        found: dict[uuid.UUID, list[Any]] = {}
        for row in rows:
            found.setdefault(row.task_id, []).append(row)
        return found

    def views(self, rows: list[Any], bindings: list[ToolBinding]) -> list[StepView]:
        """Open the rows, and give each keyed write its idempotency key."""
        by_ref = {b.ref: b for b in bindings}
        return [self._view(row, key=self._key_for(row, by_ref.get(row.tool_ref))) for row in rows]

    async def journal(self, task_id: uuid.UUID) -> list[StepView]:
        async with self._reads.connect() as conn:
            found = (
                await conn.execute(
                    text(
                        "SELECT t.node_id, i.definition_id FROM tasks t JOIN instances i ON i.id = t.instance_id "
                        "WHERE t.id = :id"
                    ),
                    {"id": task_id},
                )
            ).one_or_none()
        if found is None:
            raise not_found("task", str(task_id), "task_id")
        definition = await self._catalog.get(found.definition_id)
        rows = (await self.steps([task_id])).get(task_id, [])
        return self.views(rows, definition.bindings_for(found.node_id))

    # -- takeover ---------------------------------------------------------------------------------

    async def on_locked(self, tasks: list[LockedTask], prior_states: list[str]) -> list[LockedTask]:
        """Attach each task's journal; hold a re-offered task whose unkeyed write may have happened."""
        journals = await self.steps([t.id for t in tasks if t.attempt > 1])
        offered: list[LockedTask] = []
        for task, prior in zip(tasks, prior_states, strict=True):
            bindings = task.agent_work.tool_bindings if task.agent_work else []
            steps = self.views(journals.get(task.id, []), bindings)
            unknown = _unkeyed_writes_in_flight(steps, bindings)
            if unknown:
                async with self._engine.begin() as conn:
                    # The task was never handed out: give back the attempt the lock took.
                    await self._hold_for_a_person(
                        conn, task.id, task.instance_id, task.node_id, unknown[0], prior == "LEASED", -1
                    )
                continue
            self.remember_placement(task.id, task.definition_id, task.node_id)
            offered.append(LockedTask(**{**task.__dict__, "steps": steps}))
        return offered

    async def hold_expired_unkeyed_writes(self, limit: int = 100) -> int:
        """Raise TOOL_OUTCOME_UNKNOWN as soon as a lease runs out over an unkeyed write, not at the next fetch.

        Run periodically by every replica; SKIP LOCKED keeps them (and fetchers) out of each other's way.
        """
        held = 0
        async with self._engine.begin() as conn:
            candidates = (await conn.execute(_EXPIRED_WITH_WRITES_SQL, {"limit": limit})).all()
            journals = await self.steps([c.id for c in candidates])
            for candidate in candidates:
                definition = await self._catalog.get(candidate.definition_id)
                bindings = definition.bindings_for(candidate.node_id)
                steps = self.views(journals.get(candidate.id, []), bindings)
                unknown = _unkeyed_writes_in_flight(steps, bindings)
                if unknown:
                    await self._hold_for_a_person(
                        conn, candidate.id, candidate.instance_id, candidate.node_id, unknown[0], True, 0
                    )
                    held += 1
        return held

    async def _hold_for_a_person(
        self,
        conn: AsyncConnection,
        task_id: uuid.UUID,
        instance_id: uuid.UUID,
        node_id: str,
        step: StepView,
        taken_over: bool,
        attempt_change: int,
    ) -> None:
        details = {
            "task_id": str(task_id),
            "sequence": step.sequence,
            "attempt": step.attempt,
            "tool_ref": step.tool_ref,
            "request": step.request,
            "idempotency": "none",
            "started_at": step.created_at.isoformat(),
        }
        message = (
            f"{step.tool_ref} was sent (step {step.sequence}, attempt {step.attempt}) and its outcome is unknown; "
            "it has no idempotency key, so it is never re-sent: say whether it happened"
        )
        await conn.execute(
            text(
                "UPDATE journal_steps SET state = 'OUTCOME_UNKNOWN', updated_at = now() "
                "WHERE task_id = :id AND sequence = :sequence"
            ),
            {"id": task_id, "sequence": step.sequence},
        )
        await conn.execute(
            text(
                "UPDATE tasks SET state = 'INCIDENT', attempt = attempt + :change, lease_owner = NULL, "
                "lease_token_hash = NULL, lease_expires_at = NULL WHERE id = :id"
            ),
            {"id": task_id, "change": attempt_change},
        )
        incident_id = await raise_incident(
            conn,
            instance_id=instance_id,
            node_id=node_id,
            type_="TOOL_OUTCOME_UNKNOWN",
            message=message,
            details=details,
            task_id=task_id,
        )
        entry = HistoryEntry(
            "INCIDENT_RAISED",
            node_id,
            {
                "incident_id": str(incident_id),
                "type": "TOOL_OUTCOME_UNKNOWN",
                "message": message,
                "taken_over": taken_over,
            },
        )
        await write_history(conn, [history_row(instance_id, entry, task_id)])

    async def resolve_happened(
        self, conn: AsyncConnection, incident: Any, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person says the unknown write happened: journal their result as its response, go on."""
        if result is None:
            raise invalid("INVALID_ARGUMENT", "result", "say what the tool returned when it happened")
        sequence = int(incident.details["sequence"])
        key_id = (
            await conn.execute(
                text("SELECT key_id FROM journal_steps WHERE task_id = :id AND sequence = :s FOR UPDATE"),
                {"id": incident.task_id, "s": sequence},
            )
        ).scalar_one()
        await conn.execute(
            text(
                "UPDATE journal_steps SET state = 'COMPLETED', response_ciphertext = :ct, response_digest = :digest, "
                "updated_at = now() WHERE task_id = :id AND sequence = :s"
            ),
            {
                "ct": self._keys.seal(key_id, dumps(result).encode(), incident.task_id, sequence, "response"),
                "digest": self._keys.digest(key_id, result),
                "id": incident.task_id,
                "s": sequence,
            },
        )
        await _offer_again(conn, incident.task_id)

    async def retry_the_answer(
        self, conn: AsyncConnection, incident: Any, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person retries a rejected answer: the task comes back with its journal and the model is
        asked again; the answer's model call is set aside, and every tool result is replayed, so no
        write happens twice."""
        await conn.execute(
            text(
                "UPDATE journal_steps SET abandoned = true, updated_at = now() WHERE task_id = :id AND sequence = "
                "(SELECT max(sequence) FROM journal_steps WHERE task_id = :id AND kind = 'MODEL_CALL' "
                "AND state = 'COMPLETED' AND NOT abandoned)"
            ),
            {"id": incident.task_id},
        )
        if not await _offer_again(conn, incident.task_id):
            raise EngineError(
                Category.FAILED_PRECONDITION,
                "RESOLUTION_NOT_APPLICABLE",
                f"task {incident.task_id} is no longer held by this incident",
                field="incident_id",
            )

    async def resolve_did_not_happen(
        self, conn: AsyncConnection, incident: Any, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person says the write did not happen: the step is set aside and may be called again."""
        await conn.execute(
            text(
                "UPDATE journal_steps SET abandoned = true, updated_at = now() WHERE task_id = :id AND sequence = :s"
            ),
            {"id": incident.task_id, "s": int(incident.details["sequence"])},
        )
        await _offer_again(conn, incident.task_id)

    # -- sealing ----------------------------------------------------------------------------------

    def _write_params(
        self, step: StepRequest, guard: dict[str, Any], key_id: str, with_request: bool = True
    ) -> dict[str, Any]:
        """The parameters every step write takes: the lease guard, the step, its sealed payloads."""
        return {
            **guard,
            "sequence": step.sequence,
            "kind": step.kind,
            "state": step.state,
            "tool_ref": step.tool_ref,
            "key_id": key_id,
            **self._sealed(step, key_id, "request", step.request if with_request else None),
            **self._sealed(step, key_id, "response", step.response),
            "input_tokens": step.input_tokens,
            "output_tokens": step.output_tokens,
        }

    def _sealed(
        self, step: StepRequest, key_id: str, field: str, value: dict[str, Any] | None
    ) -> dict[str, Any]:
        if value is None:
            return {f"{field}_ct": None, f"{field}_digest": None}
        blob = self._keys.seal(key_id, dumps(value).encode(), step.task_id, step.sequence, field)
        return {f"{field}_ct": blob, f"{field}_digest": self._keys.digest(key_id, value)}

    def _open(self, row: Any, field: str) -> dict[str, Any] | None:
        blob = getattr(row, f"{field}_ciphertext")
        if blob is None:
            return None
        try:
            return json.loads(self._keys.open(row.key_id, bytes(blob), row.task_id, row.sequence, field))
        except JournalIntegrityError as error:
            raise EngineError(Category.DATA_LOSS, "JOURNAL_INTEGRITY", str(error), field="task_id") from None

    def _view(
        self,
        row: Any,
        request: dict[str, Any] | None = None,
        response: dict[str, Any] | None = None,
        key: str = "",
    ) -> StepView:
        return StepView(
            sequence=row.sequence,
            attempt=row.attempt,
            kind=row.kind,
            state=row.state,
            tool_ref=row.tool_ref,
            request=request if request is not None else self._open(row, "request"),
            response=response if response is not None else self._open(row, "response"),
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            idempotency_key=key,
            abandoned=row.abandoned,
            created_at=row.created_at,
            updated_at=row.updated_at,
        )

    def _key_for(self, row: Any, binding: ToolBinding | None) -> str:
        if binding is None or binding.policy != "write" or binding.idempotency != "key":
            return ""
        return self._idempotency.key(row.task_id, row.attempt, row.sequence)


async def _offer_again(conn: AsyncConnection, task_id: uuid.UUID) -> bool:
    topic = (
        await conn.execute(
            text(
                "UPDATE tasks SET state = 'READY', due_at = now() WHERE id = :id AND state = 'INCIDENT' "
                "RETURNING topic"
            ),
            {"id": task_id},
        )
    ).scalar_one_or_none()
    if topic is None:
        return False
    await conn.execute(text("SELECT pg_notify(:c, :t)"), {"c": TASK_CHANNEL, "t": topic})
    return True


def _unkeyed_writes_in_flight(steps: list[StepView], bindings: list[ToolBinding]) -> list[StepView]:
    """STARTED writes without an idempotency key: sent, perhaps done, and never to be re-sent blindly."""
    by_ref = {b.ref: b for b in bindings}
    return [
        s
        for s in steps
        if s.kind == "TOOL_CALL"
        and s.state == "STARTED"
        and not s.abandoned
        and (binding := by_ref.get(s.tool_ref)) is not None
        and binding.policy == "write"
        and binding.idempotency != "key"
    ]


def _binding_for(step: StepRequest, bindings: dict[str, ToolBinding]) -> ToolBinding | None:
    if step.kind == "MODEL_CALL":
        if step.tool_ref:
            raise invalid("INVALID_ARGUMENT", "tool_ref", "a model call names no tool")
        return None
    binding = bindings.get(step.tool_ref)
    if binding is None:
        raise EngineError(
            Category.FAILED_PRECONDITION,
            "BINDING_NOT_FOUND",
            f"{step.tool_ref!r} is not a tool bound to this node (bound: {', '.join(sorted(bindings)) or 'none'})",
            field="tool_ref",
        )
    if binding.policy == "write" and step.state != "STARTED":
        raise EngineError(
            Category.FAILED_PRECONDITION,
            "WRITE_NOT_STARTED",
            f"{step.tool_ref} is a write: journal it STARTED before calling it",
            field="state",
        )
    return binding


def _check_limits(step: StepRequest, counts: Any, limits: Any) -> None:
    if step.kind == "MODEL_CALL":
        calls = counts.model_calls + 1
        if calls > limits.max_model_calls:
            raise _limit(
                "max_model_calls", f"model call {calls} exceeds max_model_calls {limits.max_model_calls}"
            )
        if counts.tokens >= limits.max_tokens:
            raise _limit("max_tokens", f"{counts.tokens} tokens spent reach max_tokens {limits.max_tokens}")
    else:
        calls = counts.tool_calls + 1
        if calls > limits.max_tool_calls:
            raise _limit(
                "max_tool_calls", f"tool call {calls} exceeds max_tool_calls {limits.max_tool_calls}"
            )


def _limit(which: str, message: str) -> EngineError:
    return EngineError(
        Category.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED", message, field="sequence", metadata={"limit": which}
    )


def _check_shape(step: StepRequest) -> None:
    if step.kind not in KINDS:
        raise invalid("INVALID_ARGUMENT", "kind", "must be MODEL_CALL or TOOL_CALL")
    if step.state not in WORKER_STATES:
        raise invalid(
            "INVALID_ARGUMENT",
            "state",
            "must be STARTED, COMPLETED or FAILED (OUTCOME_UNKNOWN is the engine's)",
        )
    if step.sequence < 1:
        raise invalid("INVALID_ARGUMENT", "sequence", "starts at 1")
    if step.attempt < 1:
        raise invalid("INVALID_ARGUMENT", "attempt", "starts at 1")
    if step.input_tokens < 0 or step.output_tokens < 0:
        raise invalid("INVALID_ARGUMENT", "tokens", "cannot be negative")
    for name, value in (("request", step.request), ("response", step.response)):
        if value is not None and len(dumps(value)) > MAX_PAYLOAD_BYTES:
            raise invalid("INVALID_ARGUMENT", name, f"is larger than {MAX_PAYLOAD_BYTES} bytes as JSON")
