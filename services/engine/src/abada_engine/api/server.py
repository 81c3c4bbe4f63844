"""The gRPC server: the handlers over an `EngineCore` (`core.py`), with health and reflection."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    batch_pb2,
    batch_pb2_grpc,
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

from abada_engine.core import EngineCore
from abada_engine.runtime.queue_stats import QueueStats

from .approval_handler import ApprovalHandler
from .batch_handler import BatchHandler
from .definition_handler import DefinitionHandler
from .dependency_handler import DependencyHandler
from .external_task_handler import ExternalTaskHandler
from .guard import Guard
from .incident_handler import IncidentHandler
from .lease_handler import LeaseHandler
from .process_handler import ProcessHandler
from .queue_handler import QueueHandler

log = logging.getLogger(__name__)

# The largest request either port takes (the HTTP side's body limit too).
GRPC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
SERVICE_DESCRIPTORS = (
    definition_pb2.DESCRIPTOR.services_by_name["DefinitionService"],
    process_pb2.DESCRIPTOR.services_by_name["ProcessService"],
    external_task_pb2.DESCRIPTOR.services_by_name["ExternalTaskService"],
    incident_pb2.DESCRIPTOR.services_by_name["IncidentService"],
    lease_pb2.DESCRIPTOR.services_by_name["LeaseService"],
    queue_pb2.DESCRIPTOR.services_by_name["QueueService"],
    approval_pb2.DESCRIPTOR.services_by_name["ApprovalService"],
    dependency_pb2.DESCRIPTOR.services_by_name["DependencyService"],
    batch_pb2.DESCRIPTOR.services_by_name["BatchService"],
)
SERVICE_NAMES = tuple(service.full_name for service in SERVICE_DESCRIPTORS)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: health.HealthServicer
    # The servicers by service name: the HTTP gateway calls the very same objects.
    servicers: dict[str, Any]

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
    local_socket: str | None = None,
) -> RunningServer:
    """`shared_port`: several engine processes listen on one port (SO_REUSEPORT). `local_socket`: also
    listen on this Unix socket path, without TLS (the web console's way in, see main.py); callers
    there are authenticated by token like anywhere else."""
    options: list[tuple[str, int]] = [("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES)]
    if shared_port:
        options.append(("grpc.so_reuseport", 1))
    server = grpc.aio.server(options=options)
    handlers = _servicers(core, guard)
    for add, handler in handlers:
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
    if local_socket is not None:
        server.add_insecure_port(f"unix:{local_socket}")
    await server.start()
    log.info("engine gRPC listening", extra={"address": address, "port": port})
    servicers = {handler.SERVICE: handler for _, handler in handlers}
    return RunningServer(server, port, health_servicer, servicers)


def _servicers(
    core: EngineCore, guard: Guard | None
) -> tuple[tuple[Callable[[Any, grpc.aio.Server], None], Any], ...]:
    # Each servicer with its registration function; the pairs differ in type, so they are Any here.
    handlers: tuple[tuple[Callable[[Any, grpc.aio.Server], None], Any], ...] = (
        (
            definition_pb2_grpc.add_DefinitionServiceServicer_to_server,
            DefinitionHandler(core.catalog, core.page_tokens),
        ),
        (
            process_pb2_grpc.add_ProcessServiceServicer_to_server,
            ProcessHandler(core.instances, core.page_tokens, core.waits, core.retention, core.repairs),
        ),
        (
            external_task_pb2_grpc.add_ExternalTaskServiceServicer_to_server,
            ExternalTaskHandler(
                core.leases, core.completions, core.journal, core.approvals, core.dependencies
            ),
        ),
        (dependency_pb2_grpc.add_DependencyServiceServicer_to_server, DependencyHandler(core.dependencies)),
        (
            approval_pb2_grpc.add_ApprovalServiceServicer_to_server,
            ApprovalHandler(core.approvals, core.page_tokens),
        ),
        (
            incident_pb2_grpc.add_IncidentServiceServicer_to_server,
            IncidentHandler(core.incidents, core.page_tokens),
        ),
        (lease_pb2_grpc.add_LeaseServiceServicer_to_server, LeaseHandler(core.leases)),
        (batch_pb2_grpc.add_BatchServiceServicer_to_server, BatchHandler(core.batches)),
        (
            queue_pb2_grpc.add_QueueServiceServicer_to_server,
            QueueHandler(QueueStats(core.db), core.page_tokens),
        ),
    )
    for _, handler in handlers:
        # Health and reflection stay open: probes carry no credentials.
        handler.guard = guard
        # A request that finds PostgreSQL gone turns health NOT_SERVING at once (see db/watch.py).
        handler.database = core.database
    return handlers
