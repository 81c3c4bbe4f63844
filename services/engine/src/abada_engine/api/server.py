"""Assembling the engine: database, domain services, gRPC server with health and reflection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    definition_pb2,
    definition_pb2_grpc,
    dependency_pb2,
    dependency_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    incident_pb2,
    incident_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
)
from abada_common.reflection import enable_reflection
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import plain_url
from abada_engine.db.watch import DatabaseWatch
from abada_engine.definitions.catalog import ContractCheck, DefinitionCatalog
from abada_engine.runtime.approvals import APPROVAL_TIMEOUT, Approvals
from abada_engine.runtime.completion import Completions
from abada_engine.runtime.crypto import IdempotencyKeys, KeyRing
from abada_engine.runtime.dependencies import DEPENDENCY_UNAVAILABLE, Dependencies, DependencyBoard
from abada_engine.runtime.handed_out import HandedOut
from abada_engine.runtime.incidents import Incidents
from abada_engine.runtime.instances import Instances
from abada_engine.runtime.journal import UNKEYED_WRITE_GRACE_SECONDS, Journal, JournalResolutions, Takeover
from abada_engine.runtime.leases import TAKEOVER_GRACE_SECONDS, Leases
from abada_engine.runtime.queue_stats import QueueStats
from abada_engine.runtime.reaper import Periodic
from abada_engine.runtime.views import IncidentView
from abada_engine.runtime.wakeups import TaskWakeups
from abada_engine.store.dependencies import DEPENDENCY_CHANNEL
from abada_engine.store.hand_written import HotPath

from .approval_handler import ApprovalHandler
from .definition_handler import DefinitionHandler
from .dependency_handler import DependencyHandler
from .external_task_handler import ExternalTaskHandler
from .guard import Guard
from .incident_handler import IncidentHandler
from .lease_handler import LeaseHandler
from .process_handler import ProcessHandler
from .queue_handler import QueueHandler

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    definition_pb2.DESCRIPTOR.services_by_name["DefinitionService"].full_name,
    process_pb2.DESCRIPTOR.services_by_name["ProcessService"].full_name,
    external_task_pb2.DESCRIPTOR.services_by_name["ExternalTaskService"].full_name,
    incident_pb2.DESCRIPTOR.services_by_name["IncidentService"].full_name,
    lease_pb2.DESCRIPTOR.services_by_name["LeaseService"].full_name,
    queue_pb2.DESCRIPTOR.services_by_name["QueueService"].full_name,
    approval_pb2.DESCRIPTOR.services_by_name["ApprovalService"].full_name,
    dependency_pb2.DESCRIPTOR.services_by_name["DependencyService"].full_name,
)


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
    # What this replica remembers of the tasks it handed out (see `runtime/handed_out.py`).
    handed_out: HandedOut
    # The hand-written hot statements' own connection pool (see `store/hot_pool.py`).
    hot: HotPath
    # Whether PostgreSQL answers: the health endpoints follow it.
    database: DatabaseWatch
    # The circuits of what agent tasks depend on, and the rounds that probe them and end budgets.
    dependencies: Dependencies
    probe_rounds: Periodic
    outage_budget_rounds: Periodic

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
        incidents.register("TOOL_OUTCOME_UNKNOWN", "HAPPENED", resolutions.happened)
        incidents.register("TOOL_OUTCOME_UNKNOWN", "DID_NOT_HAPPEN", resolutions.did_not_happen)

        async def unknown_write_request(incident: IncidentView) -> dict[str, Any]:
            # Sealed at rest in the journal; opened only for the operator who reads the incident.
            if incident.task_id is None or "sequence" not in incident.details:
                return {}
            return {
                "request": await journal.opened_request(incident.task_id, int(incident.details["sequence"]))
            }

        incidents.register_details("TOOL_OUTCOME_UNKNOWN", unknown_write_request)
        for rejected in ("INVALID_OUTPUT", "LOW_CONFIDENCE"):
            incidents.register(rejected, "RETRY", resolutions.retry_the_answer)
        incidents.register(DEPENDENCY_UNAVAILABLE, "RETRY", dependencies.retry_after_outage)
        wakeups = TaskWakeups(plain_url(database_url))
        wakeups.listen(DEPENDENCY_CHANNEL, dependencies.board.changed)
        await wakeups.start()
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
        )

    async def close(self) -> None:
        await self.outage_budget_rounds.stop()
        await self.probe_rounds.stop()
        await self.approval_reaper.stop()
        await self.database.stop()
        await self.reaper.stop()
        await self.wakeups.stop()
        await self.hot.close()


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.HealthServicer

    async def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


@dataclass(frozen=True)
class ServerTls:
    """TLS for the gRPC port: the engine's certificate, and the CA its callers' certificates chain to.

    Without that CA no client certificate is asked for: callers show who they are by bearer token."""

    certificate: bytes
    private_key: bytes
    client_ca: bytes | None


async def start_grpc_server(
    core: EngineCore,
    address: str,
    guard: Guard | None,
    tls: ServerTls | None = None,
    shared_port: bool = False,
) -> RunningServer:
    """`shared_port`: several engine processes listen on one port (SO_REUSEPORT)."""
    options: list[tuple[str, int]] = [("grpc.max_receive_message_length", 8 * 1024 * 1024)]
    if shared_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options)
    # Each servicer with its registration function; the pairs differ in type, so they are Any here.
    handlers: tuple[tuple[Callable[[Any, grpc.aio.Server], None], Any], ...] = (
        (definition_pb2_grpc.add_DefinitionServiceServicer_to_server, DefinitionHandler(core.catalog)),
        (process_pb2_grpc.add_ProcessServiceServicer_to_server, ProcessHandler(core.instances)),
        (
            external_task_pb2_grpc.add_ExternalTaskServiceServicer_to_server,
            ExternalTaskHandler(
                core.leases, core.completions, core.journal, core.approvals, core.dependencies
            ),
        ),
        (dependency_pb2_grpc.add_DependencyServiceServicer_to_server, DependencyHandler(core.dependencies)),
        (approval_pb2_grpc.add_ApprovalServiceServicer_to_server, ApprovalHandler(core.approvals)),
        (incident_pb2_grpc.add_IncidentServiceServicer_to_server, IncidentHandler(core.incidents)),
        (lease_pb2_grpc.add_LeaseServiceServicer_to_server, LeaseHandler(core.leases)),
        (queue_pb2_grpc.add_QueueServiceServicer_to_server, QueueHandler(QueueStats(core.db))),
    )
    for add, handler in handlers:
        # Health and reflection stay open: probes carry no credentials.
        handler.guard = guard
        # A request that finds PostgreSQL gone turns health NOT_SERVING at once (see db/watch.py).
        handler.database = core.database
        add(handler, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    def follow_database(reachable: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if reachable
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in (*SERVICE_NAMES, ""):
            health_servicer.set(name, status)

    core.database.subscribe(follow_database)
    enable_reflection((*SERVICE_NAMES, health.SERVICE_NAME), server)
    if tls is None:
        port = server.add_insecure_port(address)
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.private_key, tls.certificate)],
            root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        port = server.add_secure_port(address, credentials)
    await server.start()
    log.info("engine gRPC listening", extra={"address": address, "port": port})
    return RunningServer(server, port, health_servicer)
