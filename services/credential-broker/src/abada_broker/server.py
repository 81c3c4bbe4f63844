"""Putting the broker together: callers, engine client, secret store, issuer, gRPC server, health.

Health (``grpc.health.v1``): the overall status ``""`` and ``abada.broker.v1.CredentialService`` are
SERVING once the secret store's check passes and NOT_SERVING while it fails (checked every
``health_interval_seconds``, every second while failing). ``liveness`` is SERVING as long as the process
serves at all: point a liveness probe there, so a Vault outage takes the broker out of rotation without
getting it restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass

import grpc
from abada.broker.v1 import credential_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .audit import AuditLog
from .auth import Callers, InsecureDevCallers, TokenFileCallers
from .config import BrokerSettings
from .engine_client import ClientTls, EngineLeaseClient, ServiceToken
from .issuer import CredentialIssuer
from .secret_store import SecretStore, SecretStoreError, secret_store_from_env
from .service import SERVICE_NAME, CredentialServicer

log = logging.getLogger("abada_broker")

LIVENESS_SERVICE = "liveness"
_FAILING_CHECK_INTERVAL_SECONDS = 1.0


def _callers(settings: BrokerSettings) -> Callers:
    if settings.auth_tokens_file is not None:
        callers = TokenFileCallers(settings.auth_tokens_file)
        log.info(
            "caller authentication from the callers file",
            extra={"path": str(settings.auth_tokens_file), "entries": len(callers)},
        )
        return callers
    log.warning(
        "INSECURE DEVELOPMENT MODE: no caller authentication. Anybody who can reach "
        f"{settings.grpc_address} is accepted as worker and engine and may fetch every tool credential. "
        "Never run like this where others can connect; use ABADA_BROKER_AUTH_TOKENS_FILE "
        "(`abada-broker dev-tokens --out DIR` writes one)."
    )
    return InsecureDevCallers()


def _engine_client(settings: BrokerSettings) -> EngineLeaseClient:
    token = ServiceToken(settings.engine_token, settings.engine_token_file)
    tls = ClientTls(settings.engine_tls_ca_file, settings.engine_tls_cert_file, settings.engine_tls_key_file)
    if not token.configured and tls.cert_file is None:
        log.warning(
            "no identity towards the engine (ABADA_ENGINE_TOKEN, ABADA_ENGINE_TOKEN_FILE or a TLS client "
            "certificate): an engine that authenticates its callers will refuse VerifyLease",
            extra={"engine": settings.engine_address},
        )
    return EngineLeaseClient(
        settings.engine_address, token, tls, timeout_seconds=settings.engine_timeout_seconds
    )


@dataclass
class RunningBroker:
    server: grpc.aio.Server
    port: int
    health: health.HealthServicer
    store: SecretStore
    engine: EngineLeaseClient
    watcher: asyncio.Task[None]

    async def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.watcher
        await self.server.stop(grace)
        await self.engine.close()
        await self.store.close()


async def _watch_secret_store(store: SecretStore, servicer: health.HealthServicer, interval: float) -> None:
    serving: bool | None = None
    while True:
        problem = ""
        try:
            await store.check()
        except SecretStoreError as error:
            problem = f"{type(error).__name__}: {error}"
        except Exception as error:  # the watcher must survive anything the store throws
            problem = f"unexpected {type(error).__name__}"
            log.exception("the secret store check failed unexpectedly")
        healthy = not problem
        if healthy is not serving:
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if healthy
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE_NAME):
                servicer.set(name, status)
            if healthy:
                log.info("the secret store is reachable: serving", extra={"store": repr(store)})
            else:
                log.warning(
                    "the secret store check failed: not serving",
                    extra={"store": repr(store), "detail": problem},
                )
            serving = healthy
        await asyncio.sleep(interval if healthy else min(interval, _FAILING_CHECK_INTERVAL_SECONDS))


async def start_broker(settings: BrokerSettings) -> RunningBroker:
    """Build everything from ``settings`` and start serving; raises on a configuration problem."""
    callers = _callers(settings)
    store = secret_store_from_env(settings.store_environ)
    engine = _engine_client(settings)
    issuer = CredentialIssuer(
        callers=callers,
        leases=engine,
        store=store,
        audit=AuditLog(),
        max_ttl=dt.timedelta(seconds=settings.max_ttl_seconds),
    )
    server = grpc.aio.server()
    credential_pb2_grpc.add_CredentialServiceServicer_to_server(CredentialServicer(issuer), server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(settings.grpc_address)
    except RuntimeError as error:
        await engine.close()
        await store.close()
        raise OSError(f"cannot listen on {settings.grpc_address}: {error}") from None
    await server.start()
    watcher = asyncio.get_running_loop().create_task(
        _watch_secret_store(store, health_servicer, settings.health_interval_seconds),
        name="secret-store-health",
    )
    log.info(
        "credential broker listening",
        extra={
            "address": settings.grpc_address,
            "port": port,
            "engine": settings.engine_address,
            "secret_store": repr(store),
            "max_ttl_seconds": settings.max_ttl_seconds,
        },
    )
    return RunningBroker(server, port, health_servicer, store, engine, watcher)
