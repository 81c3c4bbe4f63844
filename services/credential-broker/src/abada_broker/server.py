"""Putting the broker together: callers, engine client, secret store, issuer, gRPC server, health.

Health (``grpc.health.v1``): the overall status ``""`` and ``abada.broker.v1.CredentialService`` are
SERVING once the secret store's check passes and NOT_SERVING while it fails (checked every
``health_interval_seconds``, every second while failing). ``liveness`` is SERVING as long as the process
serves at all: point a liveness probe there, so a Vault outage takes the broker out of rotation without
getting it restarted.

TLS: with ``ABADA_BROKER_TLS_CERT_FILE``/``_KEY_FILE`` the port speaks TLS only, and with
``ABADA_BROKER_TLS_CLIENT_CA_FILE`` it also demands a client certificate that chains to that CA. The
kubelet's gRPC probe cannot do TLS, so ``ABADA_BROKER_HEALTH_ADDRESS`` opens a second, plaintext port that
serves ``grpc.health.v1`` and nothing else (the same statuses), never a credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada_common import openapi
from abada_common.http_gateway import Gateway
from abada_common.http_server import HttpServer, HttpTls
from abada_common.reflection import enable_reflection
from abada_sdk.connection import BearerToken, ClientTls, Connection
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .audit import AuditLog
from .auth import Callers, InsecureDevCallers, TokenFileCallers
from .config import BrokerSettings, ConfigError
from .engine_client import EngineLeaseClient
from .issuer import CredentialIssuer
from .metrics import serve_metrics
from .origins import CredentialOrigins
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
    token = BearerToken(settings.engine_token, settings.engine_token_file, what="the broker's engine token")
    tls = ClientTls(settings.engine_tls_ca_file, settings.engine_tls_cert_file, settings.engine_tls_key_file)
    if not token.configured and tls.cert_file is None:
        log.warning(
            "no identity towards the engine (ABADA_ENGINE_TOKEN, ABADA_ENGINE_TOKEN_FILE or a TLS client "
            "certificate): an engine that authenticates its callers will refuse VerifyLease",
            extra={"engine": settings.engine_address},
        )
    return EngineLeaseClient(
        Connection(settings.engine_address, token=token, tls=tls, timeout=settings.engine_timeout_seconds)
    )


def _listener_credentials(settings: BrokerSettings) -> grpc.ServerCredentials | None:
    """The TLS credentials of the credential port, or None for plaintext; an unreadable file is a
    ConfigError naming its variable."""
    if settings.tls_cert_file is None or settings.tls_key_file is None:
        return None

    def read(variable: str, path: Path) -> bytes:
        try:
            return path.read_bytes()
        except OSError as error:
            raise ConfigError(f"{variable}: cannot read {str(path)!r}: {error.strerror}") from None

    certificate = read("ABADA_BROKER_TLS_CERT_FILE", settings.tls_cert_file)
    private_key = read("ABADA_BROKER_TLS_KEY_FILE", settings.tls_key_file)
    client_ca = (
        None
        if settings.tls_client_ca_file is None
        else read("ABADA_BROKER_TLS_CLIENT_CA_FILE", settings.tls_client_ca_file)
    )
    return grpc.ssl_server_credentials(
        [(private_key, certificate)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _tls_mode(settings: BrokerSettings) -> str:
    if settings.client_certificates_required:
        return "mtls"
    return "tls" if settings.tls_enabled else "off"


def _listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise OSError(f"cannot listen on {address}: {error}") from None


@dataclass
class RunningBroker:
    server: grpc.aio.Server
    port: int
    health: health.HealthServicer
    store: SecretStore
    engine: EngineLeaseClient
    watcher: asyncio.Task[None]
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    http: HttpServer | None = None

    async def stop(self, grace: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.http is not None:
            await self.http.stop()
        self.watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.watcher
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(None)
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
    credentials = _listener_credentials(settings)
    callers = _callers(settings)
    store = secret_store_from_env(settings.store_environ)
    engine = _engine_client(settings)
    issuer = CredentialIssuer(
        callers=callers,
        leases=engine,
        store=store,
        audit=AuditLog(),
        max_ttl=dt.timedelta(seconds=settings.max_ttl_seconds),
        origins=CredentialOrigins(settings.credential_origins_file),
    )
    server = grpc.aio.server()
    servicer = CredentialServicer(issuer)
    credential_pb2_grpc.add_CredentialServiceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    enable_reflection((SERVICE_NAME, health.SERVICE_NAME), server)
    health_server: grpc.aio.Server | None = None
    health_port: int | None = None
    try:
        port = _listen(server, settings.grpc_address, credentials)
        if settings.health_address is not None:
            # Its own server: a port's services cannot differ within one server, and this one must
            # offer health alone (no reflection, no credentials) in plaintext.
            health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
            health_port = _listen(health_server, settings.health_address, None)
    except OSError:
        await engine.close()
        await store.close()
        raise
    http = _http_server(settings, servicer)
    await server.start()
    if health_server is not None:
        await health_server.start()
    if http is not None:
        try:
            await http.start()
        except (OSError, SystemExit) as error:
            await server.stop(None)
            await engine.close()
            await store.close()
            raise OSError(f"cannot listen on {settings.http_address}: {error}") from None
    if settings.metrics_address is not None:
        metrics_port = serve_metrics(settings.metrics_address)
        log.info(
            "broker metrics at /metrics", extra={"address": settings.metrics_address, "port": metrics_port}
        )
    watcher = asyncio.get_running_loop().create_task(
        _watch_secret_store(store, health_servicer, settings.health_interval_seconds),
        name="secret-store-health",
    )
    log.info(
        "credential broker listening",
        extra={
            "address": settings.grpc_address,
            "port": port,
            "tls": _tls_mode(settings),
            "health_address": settings.health_address,
            "health_port": health_port,
            "http_port": http.port if http is not None else None,
            "engine": settings.engine_address,
            "secret_store": repr(store),
            "max_ttl_seconds": settings.max_ttl_seconds,
        },
    )
    return RunningBroker(
        server,
        port,
        health_servicer,
        store,
        engine,
        watcher,
        health_server=health_server,
        health_port=health_port,
        http=http,
    )


# gRPC's default largest message, which the broker's gRPC port keeps: the HTTP body limit too.
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def _http_server(settings: BrokerSettings, servicer: CredentialServicer) -> HttpServer | None:
    """CredentialService as HTTP/JSON through the shared gateway, on the gRPC port's TLS settings."""
    if settings.http_address is None:
        return None
    services = [credential_pb2.DESCRIPTOR.services_by_name["CredentialService"]]
    gateway = Gateway({SERVICE_NAME: servicer}, services, max_body_bytes=MAX_REQUEST_BYTES)
    document = openapi.document(services, title="Abada credential broker")

    async def openapi_json(_: Request) -> Response:
        return JSONResponse(document)

    app = Starlette(routes=[Route("/v1/openapi.json", openapi_json)])
    gateway.install(app)
    tls = None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        tls = HttpTls(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    return HttpServer(app, settings.http_address, tls)
