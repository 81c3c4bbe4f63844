"""Taking over a task after its holder's lease ran out: the journal travels with the task, and a
write that may have happened without an idempotency key is held for a person, never re-sent."""

from __future__ import annotations

import uuid
from dataclasses import replace

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import EngineError
from abada_engine.runtime.background.handed_out import HandedOut
from abada_engine.runtime.crypto.sealing import StepSealer
from abada_engine.runtime.flow.navigator import IncidentToRaise
from abada_engine.runtime.held import hold_for_a_person
from abada_engine.runtime.incident_types import JOURNAL_INTEGRITY, TOOL_OUTCOME_UNKNOWN
from abada_engine.runtime.journal.rules import unkeyed_writes_in_flight
from abada_engine.runtime.views import LockedTask, StepView
from abada_engine.store import journal_steps as step_store
from abada_engine.store import tasks as task_store
from abada_engine.store.states import TaskState

OUTCOME_UNKNOWN = TOOL_OUTCOME_UNKNOWN
# How long past its lease's expiry the reaper leaves an unkeyed write to its holder (see
# `hold_expired_unkeyed_writes`): far longer than a worker's pause between two tries at the engine
# (at most 1 s) and the reaper's own period, short beside the time a person takes to look.
UNKEYED_WRITE_GRACE_SECONDS = 30.0


class Takeover:
    def __init__(
        self,
        engine: AsyncEngine,
        catalog: DefinitionCatalog,
        sealer: StepSealer,
        handed_out: HandedOut,
        unkeyed_write_grace_seconds: float = UNKEYED_WRITE_GRACE_SECONDS,
    ) -> None:
        self._engine = engine
        self._grace_ms = int(unkeyed_write_grace_seconds * 1000)
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._sealer = sealer
        self._handed_out = handed_out

    async def on_locked(self, tasks: list[LockedTask], prior_states: list[str]) -> list[LockedTask]:
        """Attach each task's journal; hold a re-offered task whose unkeyed write may have happened."""
        retried = [t.id for t in tasks if t.attempt > 1]
        journals = {}
        if retried:
            async with self._reads.connect() as conn:
                journals = await step_store.steps_of(conn, retried)
        offered: list[LockedTask] = []
        for task, prior in zip(tasks, prior_states, strict=True):
            bindings = task.agent_work.tool_bindings if task.agent_work else []
            try:
                steps = self._sealer.views(journals.get(task.id, []), bindings)
            except EngineError as error:
                if error.reason != ErrorReason.JOURNAL_INTEGRITY:
                    raise
                # One unreadable row stops this task, not the batch: the rest are handed out.
                async with self._engine.begin() as conn:
                    await self._hold_unreadable(
                        conn, task.id, task.instance_id, task.node_id, str(error), True
                    )
                continue
            unknown = unkeyed_writes_in_flight(steps, bindings)
            if unknown:
                async with self._engine.begin() as conn:
                    # The task was never handed out: give back the attempt the lock took.
                    await self._hold_for_a_person(
                        conn,
                        task.id,
                        task.instance_id,
                        task.node_id,
                        unknown[0],
                        taken_over=prior == TaskState.LEASED,
                        give_back_attempt=True,
                    )
                continue
            if task.definition_id is not None:
                self._handed_out.place(task.id, task.definition_id, task.node_id)
            offered.append(replace(task, steps=steps))
        return offered

    async def hold_expired_unkeyed_writes(self, limit: int = 100) -> int:
        """Raise TOOL_OUTCOME_UNKNOWN for an unkeyed write whose holder is gone, even if no worker asks again.

        Not the moment its lease runs out: a lease that ran out with nobody taking over is still its
        holder's (`runtime/leases.py`), and a holder that was only cut off (the engine restarting,
        PostgreSQL away, the network down) comes back with the write's answer in hand, journals it
        COMPLETED and goes on; holding the task then would hand a person a question whose answer the
        worker had. So the reaper, which acts for nobody, waits the grace past expiry; a worker's fetch
        is a takeover and holds the task at once (`on_locked`: a new attempt may not re-send the write).

        Run periodically by every replica; SKIP LOCKED keeps them (and fetchers) out of each other's way.
        """
        held = 0
        async with self._engine.begin() as conn:
            candidates = await task_store.lock_expired_leases_over_tool_calls(conn, limit, self._grace_ms)
            journals = await step_store.steps_of(conn, [c.id for c in candidates])
            for candidate in candidates:
                definition = await self._catalog.get(candidate.definition_id)
                bindings = definition.bindings_for(candidate.node_id)
                try:
                    steps = self._sealer.views(journals.get(candidate.id, []), bindings)
                except EngineError as error:
                    if error.reason != ErrorReason.JOURNAL_INTEGRITY:
                        raise
                    await self._hold_unreadable(
                        conn, candidate.id, candidate.instance_id, candidate.node_id, str(error), False
                    )
                    held += 1
                    continue
                unknown = unkeyed_writes_in_flight(steps, bindings)
                if unknown:
                    await self._hold_for_a_person(
                        conn,
                        candidate.id,
                        candidate.instance_id,
                        candidate.node_id,
                        unknown[0],
                        taken_over=True,
                        give_back_attempt=False,
                    )
                    held += 1
        return held

    async def _hold_unreadable(
        self,
        conn: AsyncConnection,
        task_id: uuid.UUID,
        instance_id: uuid.UUID,
        node_id: str,
        why: str,
        give_back_attempt: bool,
    ) -> None:
        """A journal row of this task fails authentication: no worker can resume from it, so a person decides."""
        message = f"the task's journal cannot be read: {why}"
        unreadable = IncidentToRaise(node_id, JOURNAL_INTEGRITY, message, {"task_id": str(task_id)}, task_id)
        await hold_for_a_person(conn, instance_id, unreadable, give_back_attempt=give_back_attempt)

    async def _hold_for_a_person(
        self,
        conn: AsyncConnection,
        task_id: uuid.UUID,
        instance_id: uuid.UUID,
        node_id: str,
        step: StepView,
        taken_over: bool,
        give_back_attempt: bool,
    ) -> None:
        details = {
            "task_id": str(task_id),
            "sequence": step.sequence,
            "attempt": step.attempt,
            "tool_ref": step.tool_ref,
            # The request (tool arguments) stays sealed in the journal at (task_id, sequence): the API
            # opens it for the operator who reads the incident; nothing of it is at rest in clear here.
            "idempotency": "none",
            "started_at": step.created_at.isoformat(),
        }
        message = (
            f"{step.tool_ref} was sent (step {step.sequence}, attempt {step.attempt}) and its outcome is unknown; "
            "it has no idempotency key, so it is never re-sent: say whether it happened"
        )
        await step_store.mark_outcome_unknown(conn, task_id, step.sequence)
        await hold_for_a_person(
            conn,
            instance_id,
            IncidentToRaise(node_id, OUTCOME_UNKNOWN, message, details, task_id),
            give_back_attempt=give_back_attempt,
            noted={"taken_over": taken_over},
        )
