"""The engine's HTTP side: queue depth for autoscalers, Prometheus metrics, a health check."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re

import uvicorn
from abada.engine.v1.error_reason_pb2 import ErrorReason
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from abada_engine import metrics
from abada_engine.auth import CallerRegistry
from abada_engine.db.watch import DatabaseWatch
from abada_engine.runtime.queue_stats import QueueStats

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
    console: Starlette | None = None,
) -> Starlette:
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
    return Starlette(routes=routes)


class HttpServer:
    def __init__(self, app: Starlette, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._server = uvicorn.Server(
            uvicorn.Config(app, host=host or "127.0.0.1", port=int(port), log_level="warning", lifespan="off")
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        return self._server.servers[0].sockets[0].getsockname()[1]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
