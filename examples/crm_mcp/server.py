"""`abada-demo-crm`: serve the demo CRM over MCP streamable-http under uvicorn."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from abada_common.telemetry import configure_tracing

from crm_mcp.app import MCP_PATH, build_app
from crm_mcp.tools import Variant

logger = logging.getLogger("crm_mcp.server")

GRACEFUL_SHUTDOWN_SECONDS = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    environment = os.environ
    parser = argparse.ArgumentParser(
        prog="abada-demo-crm", description="Demo CRM MCP server (get_customer, create_ticket) at /mcp."
    )
    parser.add_argument("--host", default=environment.get("CRM_MCP_HOST", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(environment.get("CRM_MCP_PORT", "8765")), help="0 picks a free port."
    )
    parser.add_argument(
        "--db",
        type=Path,
        default=Path(environment.get("CRM_MCP_DB", "crm-mcp.sqlite3")),
        help="SQLite file holding the tickets (env CRM_MCP_DB).",
    )
    parser.add_argument(
        "--token",
        default=environment.get("CRM_MCP_TOKEN"),
        help="Accepted bearer token(s), comma-separated (env CRM_MCP_TOKEN).",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        default=Path(environment["CRM_MCP_TOKEN_FILE"]) if environment.get("CRM_MCP_TOKEN_FILE") else None,
        help="File with the accepted token(s), re-read when it changes (env CRM_MCP_TOKEN_FILE).",
    )
    parser.add_argument(
        "--variant",
        choices=[variant.value for variant in Variant],
        default=environment.get("CRM_MCP_VARIANT", Variant.STANDARD.value),
        help="Which contract to offer; the non-standard ones simulate a CRM changed after deploy.",
    )
    parser.add_argument(
        "--enable-control",
        action="store_true",
        help="Serve POST /_control/variant (switch the variant live) and /_control/reset (forget every ticket"
        " and call), loopback callers only. Tests only.",
    )
    parser.add_argument(
        "--read-latency-ms",
        type=int,
        default=int(environment.get("CRM_MCP_READ_LATENCY_MS", "0")),
        help="Make get_customer take at least this long (env CRM_MCP_READ_LATENCY_MS). Tests only.",
    )
    parser.add_argument(
        "--ready-file",
        type=Path,
        help="Once listening, write {url, port} as JSON to this file (how a parent process learns the port).",
    )
    parser.add_argument("--log-level", default=environment.get("CRM_MCP_LOG_LEVEL", "INFO"))
    arguments = parser.parse_args(argv)
    if arguments.token is None and arguments.token_file is None:
        parser.error("a bearer credential is required: --token / CRM_MCP_TOKEN or --token-file")
    return arguments


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


class _AnnouncingServer(uvicorn.Server):
    """Says "ready" (log line, optional ready file) only once the socket is listening."""

    def __init__(self, config: uvicorn.Config, ready_file: Path | None) -> None:
        super().__init__(config)
        self._ready_file = ready_file

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if not self.started:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.config.host
        url_host = f"[{host}]" if ":" in host else host
        url = f"http://{url_host}:{port}{MCP_PATH}"
        if self._ready_file is not None:
            _write_atomically(self._ready_file, json.dumps({"url": url, "port": port}))
        logger.info("crm_mcp ready: serving MCP at %s", url)


def main(argv: Sequence[str] | None = None) -> None:
    arguments = parse_args(argv)
    # The MCP SDK opens a span per request, continuing the caller's trace from `_meta.traceparent`.
    configure_tracing("abada-demo-crm")
    logging.basicConfig(
        level=arguments.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        app = build_app(
            arguments.db,
            token=arguments.token,
            token_file=arguments.token_file,
            variant=arguments.variant,
            enable_control=arguments.enable_control,
            bind_host=arguments.host,
            read_latency_seconds=arguments.read_latency_ms / 1000,
        )
    except (ValueError, OSError, sqlite3.Error) as error:
        logger.error("cannot start: %s", error)
        sys.exit(2)
    logger.info(
        "tickets in %s, variant %s, control endpoint %s",
        arguments.db,
        arguments.variant,
        "enabled" if arguments.enable_control else "disabled",
    )
    config = uvicorn.Config(
        app,
        host=arguments.host,
        port=arguments.port,
        log_config=None,
        log_level=arguments.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    _AnnouncingServer(config, arguments.ready_file).run()


if __name__ == "__main__":
    main()
