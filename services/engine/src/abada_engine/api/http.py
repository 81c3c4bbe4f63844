"""The engine's HTTP side: every RPC as HTTP/JSON (abada_common.http_gateway, routes read from the protos'
HTTP rules) with its OpenAPI document at /v1/openapi.json, queue depth for autoscalers, Prometheus
metrics, a health check."""

from __future__ import annotations

import logging
import re
from typing import Any

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common import openapi
from abada_common.http_gateway import Gateway
from abada_common.http_server import HttpServer as HttpServer  # the engine's HTTP listener
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from abada_engine import metrics
from abada_engine.auth import CallerRegistry
from abada_engine.db.watch import DatabaseWatch
from abada_engine.runtime.queue_stats import QueueStats

from .server import GRPC_MAX_MESSAGE_BYTES, SERVICE_DESCRIPTORS

log = logging.getLogger(__name__)
_TOPIC = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")
STATS_ROLES = frozenset({"operator", "metrics"})
# Scrapes within this long of the last refresh share its database-wide figures.
METRICS_MAX_AGE_SECONDS = 5.0


def build_app(
    stats: QueueStats,
    registry: CallerRegistry,
    metrics_max_age_seconds: float = METRICS_MAX_AGE_SECONDS,
    database: DatabaseWatch | None = None,
    servicers: dict[str, Any] | None = None,
    console: Starlette | None = None,
) -> Starlette:
    """`servicers`: the gRPC server's (RunningServer.servicers), served as HTTP/JSON too; None serves
    only the figures and the health check."""
    figures = metrics.CachedFigures(stats, metrics_max_age_seconds)

    def refusal(request: Request) -> Response | None:
        """Why the caller may not read queue figures (both endpoints count whole tables), or None."""
        header = request.headers.get("authorization", "")
        caller = registry.by_token(header[7:].strip()) if header.lower().startswith("bearer ") else None
        if caller is None:
            return JSONResponse(
                {
                    "error": ErrorReason.Name(ErrorReason.UNAUTHENTICATED),
                    "message": "send 'Authorization: Bearer <token>'",
                },
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not caller.roles & STATS_ROLES:
            return JSONResponse(
                {
                    "error": ErrorReason.Name(ErrorReason.ROLE_REQUIRED),
                    "message": "needs the metrics or operator role",
                },
                status_code=403,
            )
        return None

    async def topic_stats(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        topic = request.path_params["topic"]
        if not _TOPIC.match(topic):
            return JSONResponse(
                {"error": "INVALID_ARGUMENT", "field": "topic", "message": "not a topic name"},
                status_code=400,
            )
        return JSONResponse((await stats.topic(topic)).to_json())

    async def prometheus(request: Request) -> Response:
        refused = refusal(request)
        if refused is not None:
            return refused
        return Response(await figures.render(), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        if database is not None and not database.reachable:
            return JSONResponse({"status": "unavailable", "reason": "DATABASE_UNAVAILABLE"}, status_code=503)
        return JSONResponse({"status": "ok"})

    routes: list[Route | Mount] = [
        Route("/v1/topics/{topic:path}/stats", topic_stats),
        Route("/metrics", prometheus),
        Route("/healthz", healthz),
    ]
    if console is not None:
        # The web console (abada_engine.console), which calls the engine's gRPC API like any client.
        routes.append(Mount("/console", console))
    if servicers is None:
        return Starlette(routes=routes)
    # The same limit as the gRPC port's largest message.
    gateway = Gateway(servicers, SERVICE_DESCRIPTORS, max_body_bytes=GRPC_MAX_MESSAGE_BYTES)
    document = openapi.document(SERVICE_DESCRIPTORS, title="Abada engine")

    async def openapi_json(_: Request) -> Response:
        return JSONResponse(document)

    app = Starlette(routes=[*routes, Route("/v1/openapi.json", openapi_json)])
    gateway.install(app)
    return app
