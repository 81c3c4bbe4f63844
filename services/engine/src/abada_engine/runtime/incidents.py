"""Incidents: what holds an instance until a person decides, and their resolutions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import EngineError, invalid, not_active, not_found, precondition
from abada_engine.runtime.calls import follow_calls
from abada_engine.runtime.flow.navigator import HistoryEntry, advance
from abada_engine.runtime.flow.tokens import (
    advance_move,
    history_record,
    move_in_locked_instance,
    write_history,
)
from abada_engine.runtime.instances import cancel_instance
from abada_engine.runtime.quota.model_quota import stops_a_fan_out
from abada_engine.runtime.views import IncidentView
from abada_engine.store import fan_out_budget as fan_out_budget_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import instances as instance_store
from abada_engine.store import tasks as task_store
from abada_engine.store.incidents import IncidentListing, IncidentRow
from abada_engine.store.moves import TokenMove
from abada_engine.store.states import IncidentState, InstanceState

RESOLUTIONS = ("RETRY", "HAPPENED", "DID_NOT_HAPPEN", "CANCEL_INSTANCE")
# How many incidents one bulk resolution takes on.
MAX_BULK = 1000


@dataclasses.dataclass(frozen=True)
class IncidentFilter:
    """Which open incidents a bulk resolution takes: of a type, and of a dependency and a process."""

    type: str
    dependency: str = ""
    process_id: str = ""


@dataclasses.dataclass(frozen=True)
class BulkRefusal:
    incident_id: uuid.UUID
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class BulkResolution:
    resolved: list[IncidentView]
    refused: list[BulkRefusal]
    # Matching incidents beyond the limit, left for another call.
    remaining: int


# A resolution that only some incident types understand (the journal adds HAPPENED / DID_NOT_HAPPEN).
ResolutionHandler = Callable[[AsyncConnection, IncidentRow, str, dict[str, Any] | None], Awaitable[None]]
DetailsOpener = Callable[[IncidentView], Awaitable[dict[str, Any]]]


class Incidents:
    def __init__(self, engine: AsyncEngine, catalog: DefinitionCatalog) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self._handlers: dict[tuple[str, str], ResolutionHandler] = {}
        self._openers: dict[str, DetailsOpener] = {}

    def register(self, incident_type: str, resolution: str, handler: ResolutionHandler) -> None:
        self._handlers[(incident_type, resolution)] = handler

    def register_details(self, incident_type: str, opener: DetailsOpener) -> None:
        """`opener(incident)` adds what is kept sealed elsewhere to the details an operator reads."""
        self._openers[incident_type] = opener

    async def _opened(self, view: IncidentView) -> IncidentView:
        opener = self._openers.get(view.type)
        if opener is None:
            return view
        return dataclasses.replace(view, details={**view.details, **await opener(view)})

    async def list(
        self,
        which: IncidentListing,
        limit: int = 1000,
        after_key: tuple[datetime, uuid.UUID] | None = None,
    ) -> list[IncidentView]:
        async with self._reads.connect() as conn:
            rows = await incident_store.listed(conn, which, limit=limit, after_key=after_key)
        return [await self._opened(r) for r in rows]

    async def resolve_matching(
        self, which: IncidentFilter, resolution: str, comment: str, limit: int
    ) -> BulkResolution:
        """Resolves every open incident `which` matches (up to `limit`), each on its own as `resolve`
        would, in its own transaction: one that cannot be resolved stops none of the others."""
        async with self._reads.connect() as conn:
            ids, total = await incident_store.open_matching(
                conn, which.type, dependency=which.dependency, process_id=which.process_id, limit=limit
            )
        resolved: list[IncidentView] = []
        refused: list[BulkRefusal] = []
        for incident_id in ids:
            try:
                resolved.append(await self.resolve(incident_id, resolution, None, comment))
            except EngineError as error:
                refused.append(BulkRefusal(incident_id, error.reason_name, error.message))
        return BulkResolution(resolved, refused, max(0, total - len(ids)))

    async def get(self, incident_id: uuid.UUID) -> IncidentView:
        async with self._reads.connect() as conn:
            rows = await incident_store.listed(conn, incident_id=incident_id)
        if not rows:
            raise not_found("incident", str(incident_id), "incident_id")
        return await self._opened(rows[0])

    async def resolve(
        self, incident_id: uuid.UUID, resolution: str, result: dict[str, Any] | None, comment: str
    ) -> IncidentView:
        async with self._engine.begin() as conn:
            await self.resolve_in(conn, incident_id, resolution, result, comment)
        return await self.get(incident_id)

    async def resolve_in(
        self,
        conn: AsyncConnection,
        incident_id: uuid.UUID,
        resolution: str,
        result: dict[str, Any] | None,
        comment: str,
    ) -> None:
        """`resolve` in the caller's transaction (a batch resolves several instances' incidents in one)."""
        if resolution not in RESOLUTIONS:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "resolution", f"must be one of {', '.join(RESOLUTIONS)}"
            )
        row = await incident_store.lock(conn, incident_id)
        if row is None:
            raise not_found("incident", str(incident_id), "incident_id")
        if row.state != IncidentState.OPEN:
            raise precondition(
                ErrorReason.INCIDENT_RESOLVED,
                f"incident {incident_id} is already resolved ({row.resolution})",
                "incident_id",
            )
        handler = self._handlers.get((row.type, resolution))
        if resolution == "CANCEL_INSTANCE":
            await self._close(conn, row, resolution, comment)
            await cancel_instance(conn, row.instance_id, comment or f"incident {incident_id} resolved")
        elif handler is not None:
            await handler(conn, row, comment, result)
            await self._close(conn, row, resolution, comment)
        elif resolution == "RETRY" and row.type not in _NEEDS_A_DECISION:
            await self._retry(conn, row)
            await self._close(conn, row, resolution, comment)
        else:
            raise precondition(
                ErrorReason.RESOLUTION_NOT_APPLICABLE,
                f"{resolution} does not apply to a {row.type} incident",
                "resolution",
            )

    async def _close(self, conn: AsyncConnection, row: IncidentRow, resolution: str, comment: str) -> None:
        await incident_store.close(conn, row.id, resolution)
        await write_history(
            conn,
            [
                history_record(
                    row.instance_id,
                    HistoryEntry(
                        "INCIDENT_RESOLVED",
                        row.node_id,
                        {
                            "incident_id": str(row.id),
                            "type": row.type,
                            "resolution": resolution,
                            "comment": comment,
                        },
                    ),
                    row.task_id,
                )
            ],
        )

    async def _retry(self, conn: AsyncConnection, row: IncidentRow) -> None:
        """A held task is offered again with fresh retries; otherwise the token re-enters the node."""
        instance = await instance_store.lock(conn, row.instance_id)
        assert instance is not None  # an incident's instance is never deleted
        if instance.state != InstanceState.ACTIVE:
            raise not_active(row.instance_id, instance.state, "incident_id")
        definition = await self._catalog.get(instance.definition_id)
        node = definition.process.node(row.node_id)
        if row.task_id is not None and await task_store.offer_again(
            conn, row.task_id, retries_left=node.retries
        ):
            if stops_a_fan_out(row.type, row.details):
                # A fan-out's spent budget stopped other items beside this one: they go on with it.
                for topic in await fan_out_budget_store.offer_held_items(conn, row.task_id, node.retries):
                    await task_store.announce_work(conn, topic)
            return

        async def decide(tokens_elsewhere: int | None) -> TokenMove:
            moved = await asyncio.to_thread(
                functools.partial(advance, tokens_elsewhere=tokens_elsewhere),
                definition.process,
                instance.variables,
                node.id,
            )
            return advance_move(instance_id=row.instance_id, advance=moved, variables=None, preceding=[])

        async def decide_beside_this_incident(live: int) -> TokenMove:
            # The incident still open (closed after this) is this very token, not another branch's.
            return await decide(live - 1 if row.task_id is None else live)

        move = await move_in_locked_instance(
            conn, row.instance_id, row.task_id, decide, decide_at_join=decide_beside_this_incident
        )
        await follow_calls(conn, self._catalog, [move])


# These ask a person what happened in the world; a blind retry is exactly what they exist to prevent.
_NEEDS_A_DECISION = frozenset({"TOOL_OUTCOME_UNKNOWN"})
