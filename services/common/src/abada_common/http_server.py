"""Serving a Starlette app with uvicorn inside a service's own event loop, optionally over TLS."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp


@dataclass(frozen=True)
class HttpTls:
    """The listener's certificate and key; with `client_ca` it also demands client certificates (mTLS)."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None


class HttpServer:
    def __init__(self, app: ASGIApp, address: str, tls: HttpTls | None = None) -> None:
        host, _, port = address.rpartition(":")
        config = uvicorn.Config(
            app,
            host=host or "127.0.0.1",
            port=int(port),
            log_level="warning",
            lifespan="off",
            # A client that keeps its connection open must not hold a stopping service for ever.
            timeout_graceful_shutdown=5,
        )
        if tls is not None:
            config.ssl_certfile = str(tls.cert_file)
            config.ssl_keyfile = str(tls.key_file)
            if tls.client_ca_file is not None:
                config.ssl_ca_certs = str(tls.client_ca_file)
                config.ssl_cert_reqs = ssl.CERT_REQUIRED
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        port: int = self._server.servers[0].sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP server stopped before it listened")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
