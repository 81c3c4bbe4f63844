"""The engine's core: its domain services over one database, wired together and started, independent of
any transport. The gRPC server (`api/server.py`) and, later, other faces serve it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import plain_url
from abada_engine.db.watch import DatabaseWatch
from abada_engine.definitions.catalog import ContractCheck, DefinitionCatalog
from abada_engine.paging import PageTokens
from abada_engine.runtime import incident_types
from abada_engine.runtime.approvals import APPROVAL_TIMEOUT, Approvals
from abada_engine.runtime.background.handed_out import HandedOut
from abada_engine.runtime.background.periodic import Periodic
from abada_engine.runtime.background.queue_upkeep import QueueUpkeep
from abada_engine.runtime.background.timer_clock import Nudged, TimerClock, waiting_on_the_world
from abada_engine.runtime.background.wakeups import TaskWakeups
from abada_engine.runtime.batches import Batches
from abada_engine.runtime.completion import Completions
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.dependencies import DEPENDENCY_UNAVAILABLE, Dependencies, DependencyBoard
from abada_engine.runtime.flow.items import FanOutEnds
from abada_engine.runtime.incidents import Incidents
from abada_engine.runtime.instances import Instances
from abada_engine.runtime.journal import UNKEYED_WRITE_GRACE_SECONDS, Journal, JournalResolutions, Takeover
from abada_engine.runtime.leases import TAKEOVER_GRACE_SECONDS, Leases
from abada_engine.runtime.repairs import Repairs
from abada_engine.runtime.retention import Retention
from abada_engine.runtime.views import IncidentView
from abada_engine.runtime.waits import Waits
from abada_engine.store.dependencies import DEPENDENCY_CHANNEL
from abada_engine.store.hand_written import HotPath


class _Stoppable(Protocol):
    async def stop(self) -> None: ...


@dataclass
class EngineCore:
    """The engine's domain services over one database, independent of any transport."""

    db: AsyncEngine
    catalog: DefinitionCatalog
    instances: Instances
    leases: Leases
    completions: Completions
    incidents: Incidents
    wakeups: TaskWakeups
    journal: Journal
    takeover: Takeover
    reaper: Periodic
    approvals: Approvals
    approval_reaper: Periodic
    # What this replica remembers of the tasks it handed out (see `runtime/background/handed_out.py`).
    handed_out: HandedOut
    # The hand-written hot statements' own connection pool (see `store/hot_pool.py`).
    hot: HotPath
    # Whether PostgreSQL answers: the health endpoints follow it.
    database: DatabaseWatch
    # The circuits of what agent tasks depend on, and the rounds that probe them and end budgets.
    dependencies: Dependencies
    probe_rounds: Periodic
    outage_budget_rounds: Periodic
    # Vacuums the queue's hot tables past a fixed number of dead rows (runtime/background/queue_upkeep.py).
    queue_upkeep: Periodic
    # Due times and messages (runtime/waits.py): the clock that fires them and the matcher of buffered
    # messages (None where a due-time process of its own runs them: `due_time_process.py`), and the
    # round that forgets expired ones.
    waits: Waits
    timer_clock: TimerClock | None
    message_matcher: Nudged | None
    message_expiry: Periodic
    # Letting old data go (runtime/retention.py): purge and erasure, and the job deleting finished
    # instances past their retention, one replica at a time.
    retention: Retention
    retention_rounds: Periodic
    # Operators repairing running instances: modifications and migrations (runtime/repairs.py).
    repairs: Repairs
    # Batch operations (runtime/batches.py) and the job working through them, on every replica.
    batches: Batches
    batch_rounds: Periodic
    # Ends a `for_each` whose last item ended on a replica that died before deciding it (runtime/flow/items.py).
    fan_out_ends: Periodic
    # Signs the lists' page tokens (a key derived from the idempotency secret every replica shares).
    page_tokens: PageTokens

    @staticmethod
    async def open(
        db: AsyncEngine,
        database_url: str,
        keys: KeyRing,
        idempotency: IdempotencyKeys,
        contract_check: ContractCheck | None = None,
        reaper_interval_seconds: float = 2.0,
        hot_pool_size: int | None = None,
        database_check_seconds: float = 1.0,
        unkeyed_write_grace_seconds: float = UNKEYED_WRITE_GRACE_SECONDS,
        takeover_grace_seconds: float = TAKEOVER_GRACE_SECONDS,
        probe_round_seconds: float = 0.5,
        queue_upkeep_seconds: float = 10.0,
        timer_idle_seconds: float = 5.0,
        retention_round_seconds: float = 30.0,
        batch_round_seconds: float = 1.0,
        fires_due_times: bool = True,
    ) -> EngineCore:
        catalog = DefinitionCatalog(db, contract_check)
        handed_out = HandedOut()
        dependencies = Dependencies(db, catalog, DependencyBoard(db))
        # The hot statements' own pool; by default half as large as SQLAlchemy's, so the engine's
        # connections grow by half, not double, next to a pool that then serves only the cold path.
        size = hot_pool_size or max(2, db.pool.size() // 2)  # type: ignore[attr-defined]
        hot = HotPath(db, await HotPath.open_pool(plain_url(database_url), size))
        journal = Journal(db, catalog, keys, idempotency, handed_out, hot, dependencies)
        takeover = Takeover(db, catalog, journal.sealer, handed_out, unkeyed_write_grace_seconds)
        resolutions = JournalResolutions(journal.sealer)
        incidents = Incidents(db, catalog)
        incidents.register(incident_types.TOOL_OUTCOME_UNKNOWN, "HAPPENED", resolutions.happened)
        incidents.register(incident_types.TOOL_OUTCOME_UNKNOWN, "DID_NOT_HAPPEN", resolutions.did_not_happen)

        async def unknown_write_request(incident: IncidentView) -> dict[str, Any]:
            # Sealed at rest in the journal; opened only for the operator who reads the incident.
            if incident.task_id is None or "sequence" not in incident.details:
                return {}
            return {
                "request": await journal.opened_request(incident.task_id, int(incident.details["sequence"]))
            }

        incidents.register_details(incident_types.TOOL_OUTCOME_UNKNOWN, unknown_write_request)
        for rejected in (incident_types.INVALID_OUTPUT, incident_types.LOW_CONFIDENCE):
            incidents.register(rejected, "RETRY", resolutions.retry_the_answer)
        incidents.register(DEPENDENCY_UNAVAILABLE, "RETRY", dependencies.retry_after_outage)
        wakeups = TaskWakeups(plain_url(database_url))
        wakeups.listen(DEPENDENCY_CHANNEL, dependencies.board.changed)
        waits = Waits(db, catalog)
        timer_clock: TimerClock | None = None
        message_matcher: Nudged | None = None
        if fires_due_times:
            timer_clock, message_matcher = waiting_on_the_world(waits, wakeups, timer_idle_seconds)
        await wakeups.start()
        for loop in (timer_clock, message_matcher):
            if loop is not None:
                loop.start()
        message_expiry = Periodic("message expiry", waits.forget_expired, queue_upkeep_seconds)
        message_expiry.start()
        reaper = Periodic(
            "outcome-unknown reaper", takeover.hold_expired_unkeyed_writes, reaper_interval_seconds
        )
        reaper.start()
        approvals = Approvals(db, catalog, journal.sealer)
        incidents.register(APPROVAL_TIMEOUT, "RETRY", approvals.ask_again)
        approval_reaper = Periodic(
            "approval-timeout reaper", approvals.expire_overdue, reaper_interval_seconds
        )
        approval_reaper.start()
        leases = Leases(
            db,
            catalog,
            wakeups,
            handed_out,
            after_lock=takeover,
            hot=hot,
            takeover_grace_seconds=takeover_grace_seconds,
            dependencies=dependencies,
        )
        probe_rounds = Periodic("dependency probes", dependencies.probe_round, probe_round_seconds)
        probe_rounds.start()
        outage_budget_rounds = Periodic("outage budgets", dependencies.budget_round, reaper_interval_seconds)
        outage_budget_rounds.start()
        queue_upkeep = Periodic("queue upkeep", QueueUpkeep(db).round, queue_upkeep_seconds)
        queue_upkeep.start()
        retention = Retention(db)
        retention_rounds = Periodic("retention", retention.round, retention_round_seconds)
        if retention_round_seconds > 0:
            retention_rounds.start()
        batches = Batches(db, incidents, catalog)
        batch_rounds = Periodic("batches", batches.round, batch_round_seconds)
        if batch_round_seconds > 0:
            batch_rounds.start()
        fan_out_ends = Periodic("fan-out ends", FanOutEnds(db, catalog).round, reaper_interval_seconds)
        fan_out_ends.start()
        database = DatabaseWatch(db, interval_seconds=database_check_seconds)
        database.subscribe(leases.database_changed)
        database.start()
        return EngineCore(
            db=db,
            catalog=catalog,
            instances=Instances(db, catalog, hot),
            leases=leases,
            completions=Completions(db, catalog, handed_out, hot),
            incidents=incidents,
            journal=journal,
            takeover=takeover,
            wakeups=wakeups,
            reaper=reaper,
            approvals=approvals,
            approval_reaper=approval_reaper,
            handed_out=handed_out,
            hot=hot,
            database=database,
            dependencies=dependencies,
            probe_rounds=probe_rounds,
            outage_budget_rounds=outage_budget_rounds,
            queue_upkeep=queue_upkeep,
            waits=waits,
            timer_clock=timer_clock,
            message_matcher=message_matcher,
            message_expiry=message_expiry,
            retention=retention,
            retention_rounds=retention_rounds,
            repairs=Repairs(db, catalog),
            batches=batches,
            batch_rounds=batch_rounds,
            fan_out_ends=fan_out_ends,
            page_tokens=PageTokens.derived_from(idempotency.secret),
        )

    async def close(self) -> None:
        # What runs in the background, in the order it stops in; the hot pool closes after it.
        background: tuple[_Stoppable | None, ...] = (
            self.fan_out_ends,
            self.batch_rounds,
            self.retention_rounds,
            self.message_expiry,
            self.message_matcher,
            self.timer_clock,
            self.queue_upkeep,
            self.outage_budget_rounds,
            self.probe_rounds,
            self.approval_reaper,
            self.database,
            self.reaper,
            self.wakeups,
        )
        for loop in background:
            if loop is not None:
                await loop.stop()
        await self.hot.close()
