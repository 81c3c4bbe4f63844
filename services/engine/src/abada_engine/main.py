"""`abada-engine`: serve the engine, or apply its migrations (`abada-engine migrate`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from .api.server import EngineCore, start_grpc_server
from .config import EngineSettings
from .db.database import create_engine
from .db.embedded import start_embedded_postgres
from .db.migrate import migrate
from .definitions.tool_contracts import McpContractCheck, credentials_from_env
from .logs import configure_logging
from .runtime.crypto import idempotency_from_env, journal_keys_from_env

log = logging.getLogger("abada_engine")


def _database_url(settings: EngineSettings) -> tuple[str, object | None]:
    if settings.database_url:
        return settings.database_url, None
    return start_embedded_postgres(settings.state_dir / "pgdata")


async def serve(settings: EngineSettings) -> None:
    url, embedded = _database_url(settings)
    db = create_engine(url, settings.db_pool_size)
    await migrate(db)
    env = dict(os.environ)
    core = await EngineCore.open(
        db,
        url,
        journal_keys_from_env(env, settings.state_dir),
        idempotency_from_env(env, settings.state_dir),
        McpContractCheck(credentials_from_env(env), float(env.get("ABADA_DEPLOY_MCP_TIMEOUT_SECONDS", "10"))),
    )
    running = await start_grpc_server(core, settings.grpc_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("engine ready", extra={"grpc_port": running.port})
    await stop.wait()
    log.info("engine stopping")
    await running.stop()
    await core.close()
    await db.dispose()
    del embedded


async def migrate_only(settings: EngineSettings) -> None:
    url, _embedded = _database_url(settings)
    db = create_engine(url, 1)
    await migrate(db)
    await db.dispose()
    log.info("migrations applied")


def main() -> None:
    parser = argparse.ArgumentParser(prog="abada-engine", description=__doc__)
    parser.add_argument("command", nargs="?", default="serve", choices=["serve", "migrate"])
    args = parser.parse_args()
    settings = EngineSettings.from_env()
    configure_logging("engine", settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings) if args.command == "serve" else migrate_only(settings))


if __name__ == "__main__":
    main()
