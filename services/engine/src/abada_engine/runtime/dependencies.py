"""Waiting out the outages of what agent tasks depend on: one circuit per dependency, shared by all.

A worker whose call to a dependency (a model, a tool server, the broker, the secret store) failed
for a temporary reason reports it (`report`). The first report of an outage opens the dependency's
circuit (DOWN) and makes the reporting task its probe; every other task bound to the dependency is
held back from then on: parked at its next report, at its next fetch (`hold_back`), or refused at
its next model call or write (`gate`) before it reaches the dependency. The probe keeps its lease
while the next try is near (a short wait) and is parked like the others when it is not; at each
probe time one parked task goes out as the probe (PROBING). The first call that gets through closes
the circuit (UP) and every parked task is offered again at once; the replay on the next fetch pays
for no model turn twice.

Probe times back off exponentially with full jitter, from 1 s doubling to 60 s, never sooner than a
Retry-After the dependency gave. A task waits out outages for its node's `outage_budget` (30 minutes
unless the node says otherwise); past it, a DEPENDENCY_UNAVAILABLE incident holds it, naming the
dependency and how long the task waited. Retrying that incident probes the dependency at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.definitions.catalog import Definition, DefinitionCatalog
from abada_engine.definitions.model import Node
from abada_engine.errors import Category, EngineError, invalid, precondition
from abada_engine.runtime.flow.navigator import HistoryEntry, IncidentToRaise
from abada_engine.runtime.flow.tokens import history_record, write_history
from abada_engine.runtime.held import hold_for_a_person
from abada_engine.runtime.incident_types import DEPENDENCY_UNAVAILABLE
from abada_engine.runtime.leases import hold_lease
from abada_engine.runtime.views import HeldBack
from abada_engine.store import dependencies as circuit_store
from abada_engine.store import tasks as task_store
from abada_engine.store.dependencies import CircuitRow, ListedCircuit
from abada_engine.store.hand_written import Executor
from abada_engine.store.incidents import IncidentRow
from abada_engine.store.states import DependencyState, TaskState
from abada_engine.store.tasks import LockedRow, OutageStreak

log = logging.getLogger(__name__)

KINDS = ("model", "tool_server", "broker", "secret_store")
# The broker and its secret store are one each per deployment: their circuits have these names.
BROKER = "broker"
SECRET_STORE = "secret-store"
DEFAULT_OUTAGE_BUDGET_SECONDS = 1800.0
FIRST_PROBE_SECONDS = 1.0
MAX_PROBE_SECONDS = 60.0
# A probe whose next try is at most this far away keeps its lease and waits; a later one is parked.
SHORT_WAIT_SECONDS = 5.0
# How soon a probe refused by a replica whose view lagged asks again.
STALE_VIEW_RETRY_SECONDS = 0.2
# A replica's view of the circuits is read again at least this often (notifications may be missed).
VIEW_MAX_AGE_SECONDS = 1.0
ROUND_LIMIT = 100
MAX_ERROR_CHARS = 2_000


def dependency_key(kind: str, name: str) -> str:
    return f"{kind}:{name}"


def split_key(key: str) -> tuple[str, str]:
    kind, _, name = key.partition(":")
    return kind, name


def dependencies_of(definition: Definition, node: Node) -> tuple[str, ...]:
    """What a task at `node` needs to get anywhere: its model, every tool server it binds, and the
    broker and its secret store when a server needs a credential. Service tasks need none the engine
    knows of (their handlers wait out their own outages, `Completions.fail` with `transient`)."""
    if node.type != "agent":
        return ()
    keys = [dependency_key("model", node.model or "")]
    bindings = definition.bindings_for(node.id)
    for server in dict.fromkeys(binding.server for binding in bindings):
        keys.append(dependency_key("tool_server", server))
    if any(binding.credential for binding in bindings):
        keys += [dependency_key("broker", BROKER), dependency_key("secret_store", SECRET_STORE)]
    return tuple(keys)


def outage_budget_ms(node: Node) -> int:
    seconds = node.outage_budget_seconds
    return int((DEFAULT_OUTAGE_BUDGET_SECONDS if seconds is None else seconds) * 1000)


def next_probe_delay(failed_probes: int, retry_after_seconds: float, rng: random.Random) -> float:
    """Exponential backoff with full jitter: up to 1 s after the first failure, doubling with every
    failed probe to 60 s; never sooner than the dependency asked."""
    cap = min(MAX_PROBE_SECONDS, FIRST_PROBE_SECONDS * 2**failed_probes)
    return max(retry_after_seconds, rng.uniform(0, cap))


@dataclass(frozen=True)
class Circuit:
    """A replica's view of one dependency that is not up."""

    key: str
    state: str
    probe_task_id: uuid.UUID | None
    next_probe_at: datetime | None

    def holds(self, task_id: uuid.UUID) -> bool:
        return self.state != DependencyState.UP and self.probe_task_id != task_id


class DependencyBoard:
    """This replica's view of the circuits that are not up, read again on every change any replica
    announces (`abada_dependencies`) and at least every second. It decides nothing for good: the
    statements that park a task judge by the circuits as they are in the database."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._reads = autocommit(engine)
        self._circuits: dict[str, Circuit] = {}
        self._read_at = 0.0
        self._stale = True
        self._lock = asyncio.Lock()

    def changed(self, _key: str = "") -> None:
        """A replica changed a circuit: read them again before the next decision that needs them."""
        self._stale = True

    @property
    def anything_down(self) -> bool:
        """Whether some dependency was down when last read (a cheap test for the hot paths)."""
        return bool(self._circuits) or self._stale

    async def current(self) -> dict[str, Circuit]:
        if self._stale or time.monotonic() - self._read_at > VIEW_MAX_AGE_SECONDS:
            async with self._lock:
                if self._stale or time.monotonic() - self._read_at > VIEW_MAX_AGE_SECONDS:
                    self._stale = False
                    async with self._reads.connect() as conn:
                        rows = await circuit_store.not_up(conn)
                    self._circuits = {row.key: _circuit(row) for row in rows}
                    self._read_at = time.monotonic()
        return self._circuits


def _circuit(row: CircuitRow) -> Circuit:
    return Circuit(row.key, row.state, row.probe_task_id, row.next_probe_at)


@dataclass(frozen=True)
class Report:
    task_id: uuid.UUID
    worker_id: str
    lease_token: str
    kind: str
    name: str
    up: bool
    error: str = ""
    retry_after_seconds: float = 0.0
    not_called: bool = False
    # The worker can wait with its lease and try again in place (see ReportDependencyRequest).
    wait_in_place: bool = True


@dataclass(frozen=True)
class Decision:
    """What the reporting worker does next."""

    action: str  # CONTINUE, WAIT, PARKED or INCIDENT_RAISED
    retry_at: datetime | None = None
    incident_id: uuid.UUID | None = None
    probe: bool = False


class Dependencies:
    def __init__(
        self, engine: AsyncEngine, catalog: DefinitionCatalog, board: DependencyBoard, seed: int | None = None
    ) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._catalog = catalog
        self.board = board
        self._rng = random.Random(seed)

    # --- what workers report --------------------------------------------------------------------

    async def report(self, report: Report) -> Decision:
        try:
            return await self._decide(report)
        finally:
            # A circuit may have changed: this replica holds calls back at once, before the
            # notification every replica hears comes round.
            self.board.changed()

    async def _decide(self, report: Report) -> Decision:
        if report.kind not in KINDS:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "dependency.kind", f"must be one of {', '.join(KINDS)}"
            )
        if not report.name.strip() or len(report.name) > 200:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                "dependency.name",
                "name the dependency (at most 200 characters)",
            )
        key = dependency_key(report.kind, report.name)
        error = report.error[:MAX_ERROR_CHARS]
        async with self._engine.begin() as conn:
            # The holder of a lease that ran out while it waited still holds it until someone takes
            # the task over (see `leases`): its report is taken.
            held = await hold_lease(
                conn, report.task_id, report.worker_id, report.lease_token, expired_ok=True
            )
            definition = await self._catalog.get(held.definition_id)
            node = definition.process.node(held.node_id)
            if key not in dependencies_of(definition, node):
                raise precondition(
                    ErrorReason.DEPENDENCY_NOT_BOUND,
                    f"task {report.task_id} at node {node.id!r} does not depend on {key!r}",
                    "dependency",
                )
            circuit = await circuit_store.lock(conn, key, report.kind, report.name)
            if report.up:
                await self._answered(conn, circuit, report.task_id, held.instance_id, node.id)
                return Decision("CONTINUE")
            streak, incident_id = await note_outage_or_hold(
                conn, report.task_id, held.instance_id, node, key, error
            )
            if incident_id is not None:
                return Decision("INCIDENT_RAISED", incident_id=incident_id)
            now = streak.now
            if report.not_called:
                # The call was never made (held back by the engine, or by the worker's own view of
                # the dependency): no failure of it.
                # Nothing broke on the worker's side, so it can always ask again in place.
                soon = now + timedelta(seconds=STALE_VIEW_RETRY_SECONDS)
                if circuit.state == DependencyState.UP:
                    return Decision("WAIT", soon)
                if circuit.probe_task_id == report.task_id:
                    return Decision("WAIT", soon, probe=True)
                return await self._park(
                    conn, report, key, circuit.next_probe_at, held.instance_id, node.id, error
                )
            retry_after = report.retry_after_seconds
            if circuit.state == DependencyState.UP:
                next_probe = now + timedelta(seconds=next_probe_delay(0, retry_after, self._rng))
                await circuit_store.open_circuit(conn, key, error, next_probe, report.task_id)
                log.warning(
                    "dependency down",
                    extra={"dependency": key, "error": error, "task_id": str(report.task_id)},
                )
                probe = True
            elif circuit.probe_task_id == report.task_id:
                delay = next_probe_delay(circuit.failed_probes + 1, retry_after, self._rng)
                next_probe = now + timedelta(seconds=delay)
                await circuit_store.probe_failed(conn, key, error, next_probe, report.task_id)
                probe = True
            else:
                not_before = now + timedelta(seconds=retry_after) if retry_after else None
                await circuit_store.note_failure(conn, key, error, not_before)
                next_probe = circuit.next_probe_at or now
                if not_before is not None and not_before > next_probe:
                    next_probe = not_before
                probe = False
            if probe and report.wait_in_place and (next_probe - now).total_seconds() <= SHORT_WAIT_SECONDS:
                return Decision("WAIT", next_probe, probe=True)
            if probe:
                await circuit_store.let_probe_go(conn, key)
            return await self._park(conn, report, key, next_probe, held.instance_id, node.id, error)

    async def _answered(
        self,
        conn: AsyncConnection,
        circuit: CircuitRow,
        task_id: uuid.UUID,
        instance_id: uuid.UUID,
        node_id: str,
    ) -> None:
        await task_store.end_outage(conn, task_id)
        if circuit.state == DependencyState.UP:
            return
        await circuit_store.close_circuit(conn, circuit.key)
        released = await task_store.release_parked(conn, circuit.key)
        down_for = (
            (await circuit_store.database_now(conn)) - circuit.down_since if circuit.down_since else None
        )
        log.warning(
            "dependency up",
            extra={
                "dependency": circuit.key,
                "released_tasks": released,
                "down_seconds": round(down_for.total_seconds(), 3) if down_for else None,
            },
        )
        entry = HistoryEntry(
            "DEPENDENCY_UP", node_id, {"dependency": circuit.key, "released_tasks": released}
        )
        await write_history(conn, [history_record(instance_id, entry, task_id)])

    async def _park(
        self,
        conn: AsyncConnection,
        report: Report,
        key: str,
        next_probe: datetime | None,
        instance_id: uuid.UUID,
        node_id: str,
        error: str,
    ) -> Decision:
        await task_store.park(conn, report.task_id, key)
        data: dict[str, Any] = {"dependency": key, "worker_id": report.worker_id, "error": error}
        if next_probe is not None:
            data["next_probe"] = next_probe.isoformat()
        await write_history(
            conn, [history_record(instance_id, HistoryEntry("TASK_PARKED", node_id, data), report.task_id)]
        )
        return Decision("PARKED", next_probe)

    # --- what fetches and the journal hold back ---------------------------------------------------

    async def hold_back(self, conn: Executor, locked: Sequence[LockedRow]) -> HeldBack:
        """Of the tasks a fetch just locked, parks those a dependency that is down holds (each parking in
        its instance's history), and names the dependencies each of the others probes."""
        circuits = await self.board.current()
        if not circuits:
            return HeldBack({}, {})
        task_ids: list[uuid.UUID] = []
        keys: list[str] = []
        budgets: list[int] = []
        for task_id, definition_id, node_id in ((row.id, row.definition_id, row.node_id) for row in locked):
            definition = await self._catalog.get(definition_id)
            node = definition.process.node(node_id)
            for key in dependencies_of(definition, node):
                if key in circuits:
                    task_ids.append(task_id)
                    keys.append(key)
                    budgets.append(outage_budget_ms(node))
        if not task_ids:
            return HeldBack({}, {})
        parked = await task_store.hold_for_dependencies(conn, task_ids, keys, budgets)
        if parked:
            async with self._engine.begin() as history_conn:
                await write_history(
                    history_conn,
                    [
                        history_record(
                            row.instance_id,
                            HistoryEntry(
                                "TASK_PARKED", row.node_id, {"dependency": parked[row.id], "at": "fetch"}
                            ),
                            row.id,
                        )
                        for row in locked
                        if row.id in parked
                    ],
                )
        probes: dict[uuid.UUID, tuple[str, ...]] = {}
        for task_id, key in zip(task_ids, keys, strict=True):
            if task_id not in parked and circuits[key].probe_task_id == task_id:
                probes[task_id] = (*probes.get(task_id, ()), key)
        return HeldBack(parked, probes)

    async def gate(self, task_id: uuid.UUID, key: str) -> None:
        """Refuses a call that would reach `key` while it is down, unless this task is its probe: the
        worker then reports the refusal (`not_called`) and the task is parked without the call."""
        if not self.board.anything_down:
            return
        circuit = (await self.board.current()).get(key)
        if circuit is None or not circuit.holds(task_id):
            return
        wait = None
        if circuit.next_probe_at is not None:
            wait = max(
                0.0, (circuit.next_probe_at - datetime.now(circuit.next_probe_at.tzinfo)).total_seconds()
            )
        raise EngineError(
            Category.FAILED_PRECONDITION,
            ErrorReason.DEPENDENCY_UNAVAILABLE,
            f"{key} is down ({circuit.state.lower()}): this call would wait for it; report it and hand the task back",
            field="dependency",
            metadata={"dependency": key},
            retry_after_seconds=wait,
        )

    # --- the engine's own rounds ------------------------------------------------------------------

    async def probe_round(self) -> int:
        """Sends the probes that are due, and reopens circuits whose probe left without a word."""
        handled = 0
        async with self._engine.begin() as conn:
            for standing in await circuit_store.lost_probes(conn, ROUND_LIMIT):
                if standing.task_state == TaskState.COMPLETED:
                    # The probe finished its work: whatever it needed answered.
                    await circuit_store.close_circuit(conn, standing.key)
                    released = await task_store.release_parked(conn, standing.key)
                    log.warning(
                        "dependency up", extra={"dependency": standing.key, "released_tasks": released}
                    )
                else:
                    # Cancelled, held by an incident or parked for another dependency: another goes out now.
                    await circuit_store.probe_now(conn, standing.key)
                handled += 1
        async with self._engine.begin() as conn:
            for circuit in await circuit_store.due_probes(conn, ROUND_LIMIT):
                probe = await task_store.release_probe(conn, circuit.key)
                if probe is not None:
                    await circuit_store.send_probe(conn, circuit.key, probe)
                    handled += 1
        return handled

    async def budget_round(self) -> int:
        """Raises one DEPENDENCY_UNAVAILABLE incident for each parked task whose outage budget ran out."""
        async with self._engine.begin() as conn:
            overdue = await task_store.lock_overdue_parked(conn, ROUND_LIMIT)
            for task in overdue:
                await raise_unavailable(
                    conn,
                    task.id,
                    task.instance_id,
                    task.node_id,
                    task.parked_on,
                    task.waiting_since,
                    task.now,
                    "",
                )
        return len(overdue)

    # --- what operators see and do ----------------------------------------------------------------

    async def listed(self) -> list[ListedCircuit]:
        async with self._reads.connect() as conn:
            return await circuit_store.listed(conn)

    async def retry_after_outage(
        self, conn: AsyncConnection, incident: IncidentRow, comment: str, result: dict[str, Any] | None
    ) -> None:
        """RETRY of a DEPENDENCY_UNAVAILABLE incident: the task is offered again with a fresh outage
        budget, and the dependency is probed at once (the operator says it is back)."""
        if incident.task_id is None or not await task_store.offer_again(conn, incident.task_id):
            raise precondition(
                ErrorReason.TASK_NOT_HELD,
                f"incident {incident.id} holds no task to offer again",
                "incident_id",
            )
        key = str(incident.details.get("dependency", ""))
        if key:
            await circuit_store.probe_now(conn, key)


async def note_outage_or_hold(
    conn: AsyncConnection, task_id: uuid.UUID, instance_id: uuid.UUID, node: Node, key: str, error: str
) -> tuple[OutageStreak, uuid.UUID | None]:
    """The task failed for a while on `key` once more: its waiting streak, and the DEPENDENCY_UNAVAILABLE
    incident that now holds it if the streak spent the node's outage budget."""
    streak = await task_store.note_outage(conn, task_id, outage_budget_ms(node))
    if not streak.budget_spent:
        return streak, None
    incident_id = await raise_unavailable(
        conn, task_id, instance_id, node.id, key, streak.waiting_since, streak.now, error
    )
    return streak, incident_id


async def raise_unavailable(
    conn: AsyncConnection,
    task_id: uuid.UUID,
    instance_id: uuid.UUID,
    node_id: str,
    key: str,
    waiting_since: datetime,
    now: datetime,
    error: str,
) -> uuid.UUID:
    waited = (now - waiting_since).total_seconds()
    kind, name = split_key(key)
    details: dict[str, Any] = {
        "dependency": key,
        "kind": kind,
        "name": name,
        "waiting_since": waiting_since.isoformat(),
        "waited_seconds": round(waited, 3),
    }
    if error:
        details["last_error"] = error
    message = f"{kind.replace('_', ' ')} {name!r} has been unavailable for {_duration(waited)}, past the node's outage_budget"
    return await hold_for_a_person(
        conn,
        instance_id,
        IncidentToRaise(node_id, DEPENDENCY_UNAVAILABLE, message, details, task_id),
        last_error={"code": DEPENDENCY_UNAVAILABLE, "message": message},
    )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
