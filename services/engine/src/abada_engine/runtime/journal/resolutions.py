"""How a person's decision on a journal incident changes the journal, before the task is offered again."""

from __future__ import annotations

from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection

from abada_engine.errors import invalid, precondition
from abada_engine.runtime.crypto.sealing import Place, StepSealer
from abada_engine.store import journal_steps as step_store
from abada_engine.store import tasks as task_store
from abada_engine.store.incidents import IncidentRow


class JournalResolutions:
    """Resolution handlers the incident service calls inside its transaction (see `Incidents.register`)."""

    def __init__(self, sealer: StepSealer) -> None:
        self._sealer = sealer

    async def happened(
        self, conn: AsyncConnection, incident: IncidentRow, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person says the unknown write happened: journal their result as its response, go on."""
        if result is None:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "result", "say what the tool returned when it happened"
            )
        assert incident.task_id is not None  # a journal incident always names its task
        sequence = int(incident.details["sequence"])
        # Locked: the row cannot be sealed again (`abada-engine reseal`) between this read and the write.
        step = await step_store.lock_step(conn, incident.task_id, sequence)
        sealed, digest = self._sealer.seal(Place.of(step), "response", result)
        assert sealed is not None and digest is not None
        await step_store.complete_with_response(conn, incident.task_id, sequence, sealed, digest)
        await task_store.offer_again(conn, incident.task_id)

    async def did_not_happen(
        self, conn: AsyncConnection, incident: IncidentRow, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person says the write did not happen: the step is set aside and may be called again."""
        assert incident.task_id is not None
        await step_store.set_aside(conn, incident.task_id, int(incident.details["sequence"]))
        await task_store.offer_again(conn, incident.task_id)

    async def retry_the_answer(
        self, conn: AsyncConnection, incident: IncidentRow, comment: str, result: dict[str, Any] | None
    ) -> None:
        """A person retries a rejected answer: the task comes back with its journal and the model is
        asked again; the answer's model call is set aside, and every tool result is replayed, so no
        write happens twice."""
        assert incident.task_id is not None
        await step_store.set_aside_last_answer(conn, incident.task_id)
        if not await task_store.offer_again(conn, incident.task_id):
            raise precondition(
                ErrorReason.RESOLUTION_NOT_APPLICABLE,
                f"task {incident.task_id} is no longer held by this incident",
                "incident_id",
            )
