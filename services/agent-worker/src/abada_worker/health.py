"""`GET /healthz` for the Kubernetes probes and `GET /metrics` for Prometheus, over plain HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

_READ_TIMEOUT_SECONDS = 5.0


class HealthServer:
    """Answers 200 with the worker's state while the process and its event loop are alive."""

    def __init__(self, status: Callable[[], dict[str, object]]) -> None:
        self._status = status
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        self._server = await asyncio.start_server(self._serve, host or "127.0.0.1", int(port))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_SECONDS)
            while (await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_SECONDS)) not in (
                b"\r\n",
                b"\n",
                b"",
            ):
                pass
            method, path = _method_and_path(request_line)
            if method not in ("GET", "HEAD"):
                await _respond(writer, 405, {"error": "only GET"}, method == "HEAD")
            elif path == "/metrics":
                await _respond_bytes(writer, 200, generate_latest(), CONTENT_TYPE_LATEST, method == "HEAD")
            elif path != "/healthz":
                await _respond(writer, 404, {"error": "not found"}, method == "HEAD")
            else:
                await _respond(writer, 200, self._status(), method == "HEAD")
        except (TimeoutError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _method_and_path(request_line: bytes) -> tuple[str, str]:
    parts = request_line.decode("latin-1").split()
    if len(parts) < 2:
        raise ValueError("not an HTTP request")
    return parts[0], parts[1].split("?", 1)[0]


async def _respond(
    writer: asyncio.StreamWriter, status: int, body: dict[str, object], head_only: bool
) -> None:
    await _respond_bytes(writer, status, json.dumps(body).encode(), "application/json", head_only)


async def _respond_bytes(
    writer: asyncio.StreamWriter, status: int, payload: bytes, content_type: str, head_only: bool
) -> None:
    reasons = {200: "OK", 404: "Not Found", 405: "Method Not Allowed"}
    head = (
        f"HTTP/1.1 {status} {reasons[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    writer.write(head if head_only else head + payload)
    await writer.drain()
