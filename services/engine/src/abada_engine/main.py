"""`abada-engine`: serve the engine, apply its migrations (`abada-engine migrate`), or seal every
journal value at rest again under the primary key (`abada-engine reseal`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Coroutine
from importlib import metadata
from typing import Any

from abada_common.logs import JsonFormatter, configure_logging
from abada_common.telemetry import configure_tracing
from abada_sdk.connection import Connection

from .api.guard import Guard
from .api.http import HttpServer, build_app
from .api.server import ServerTls, start_grpc_server
from .auth import CallerRegistry, write_dev_callers
from .config import EXTRA_PROCESS, EngineSettings, SettingsError
from .console import Engine, build_console
from .core import EngineCore
from .db.database import create_engine
from .db.embedded import start_embedded_postgres
from .db.migrate import migrate
from .db.reachability import DatabaseUnreachable, require_database
from .definitions.tool_contracts import McpContractCheck, credentials_from_env
from .due_time_process import DUE_TIME_PROCESS, DueTimeProcess, fire_due_times
from .runtime.crypto.keys import IdempotencyKeys, KeyRing, idempotency_from_env, journal_keys_from_env
from .runtime.crypto.reseal import Resealer
from .runtime.crypto.sealing import StepSealer
from .runtime.queue_stats import QueueStats

log = logging.getLogger("abada_engine")


def _database_url(settings: EngineSettings) -> tuple[str, object | None]:
    if settings.database_url:
        return settings.database_url, None
    return start_embedded_postgres(settings.state_dir / "pgdata")


async def serve(settings: EngineSettings) -> None:
    env = dict(os.environ)
    _require_real_secrets(settings)
    url, embedded = _database_url(settings)
    # ABADA_DB_POOL_SIZE connections in all: most for the hot statements' own pool (store/hot_pool.py), a
    # quarter for everything else through SQLAlchemy.
    cold = max(2, settings.db_pool_size // 4)
    db = create_engine(url, cold)
    await _require(db, url, settings)
    if not settings.extra_process:
        await migrate(db)
    try:
        journal_keys = journal_keys_from_env(env, settings.state_dir)
        idempotency = idempotency_from_env(env, settings.state_dir)
    except ValueError as error:
        raise SystemExit(f"the engine cannot start: {error}") from None
    core = await EngineCore.open(
        db,
        url,
        journal_keys,
        idempotency,
        McpContractCheck(credentials_from_env(env), settings.deploy_mcp_timeout_seconds),
        hot_pool_size=max(2, settings.db_pool_size - cold),
        retention_round_seconds=settings.retention_round_seconds,
        batch_round_seconds=settings.batch_round_seconds,
        fires_due_times=not settings.due_time_process,
    )
    due_times = None
    if settings.due_time_process and not settings.extra_process:
        due_times = DueTimeProcess({**env, "ABADA_DATABASE_URL": url})
        due_times.start()
    registry = CallerRegistry(_callers_file(settings))
    # The web console reaches this engine's gRPC API over a Unix socket in a private directory (0700):
    # no TLS client certificate to hand it, and nothing off this machine (or of another user) gets in.
    console_dir = None if settings.extra_process else pathlib.Path(tempfile.mkdtemp(prefix="abada-console-"))
    console_socket = str(console_dir / "engine.sock") if console_dir is not None else None
    running = await start_grpc_server(
        core,
        settings.grpc_address,
        Guard(registry),
        _server_tls(settings),
        shared_port=settings.processes > 1,
        local_socket=console_socket,
    )
    http = None
    extra: list[subprocess.Popen[bytes]] = []
    console_engine = Engine(Connection(address=f"unix:{console_socket}"))
    if not settings.extra_process:
        # Session cookies are sealed with a key derived from the idempotency secret: every replica has it.
        console = build_console(console_engine, idempotency.secret)
        http = HttpServer(
            build_app(
                QueueStats(db),
                registry,
                database=core.database,
                servicers=running.servicers if settings.http_api else None,
                console=console,
            ),
            settings.http_address,
        )
        await http.start()
        extra = _start_extra_processes(settings, url, running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("engine ready", extra={"grpc_port": running.port})
    await stop.wait()
    log.info("engine stopping")
    for process in extra:
        process.terminate()
    if http is not None:
        await http.stop()
    await console_engine.close()
    await running.stop()
    if console_dir is not None:
        shutil.rmtree(console_dir, ignore_errors=True)
    for process in extra:
        await asyncio.to_thread(process.wait)
    if due_times is not None:
        await due_times.stop()
    await core.close()
    await db.dispose()
    del embedded


# A database that cannot be used at start is the operator's to fix, as a bad setting is.
DATABASE_EXIT_CODE = 2


async def _require(db: Any, url: str, settings: EngineSettings) -> None:
    setting = "ABADA_DATABASE_URL" if settings.database_url else "the embedded PostgreSQL"
    try:
        await require_database(db, url, setting)
    except DatabaseUnreachable as error:
        await db.dispose()
        print(f"abada-engine: {error}", file=sys.stderr, flush=True)
        raise SystemExit(DATABASE_EXIT_CODE) from None


def _start_extra_processes(settings: EngineSettings, url: str, port: int) -> list[subprocess.Popen[bytes]]:
    """ABADA_ENGINE_PROCESSES - 1 more engines on the same gRPC port; the kernel spreads connections.

    They share the database, keys and callers; this first process alone migrates and serves HTTP.
    What a process remembers of the tasks it handed out is its own: a Complete that reaches
    another process takes the careful path (read, then write), as with several replicas.
    """
    if settings.processes <= 1:
        return []
    host = settings.grpc_address.rsplit(":", 1)[0]
    env = {
        **os.environ,
        "ABADA_DATABASE_URL": url,
        "ABADA_GRPC_ADDRESS": f"{host}:{port}",
        EXTRA_PROCESS: "1",
        "ABADA_ENGINE_PROCESSES": str(settings.processes),
    }
    log.info(
        "starting more engine processes on the same port",
        extra={"processes": settings.processes, "port": port},
    )
    return [
        subprocess.Popen([sys.executable, "-m", "abada_engine.main", "serve"], env=env)
        for _ in range(settings.processes - 1)
    ]


def _require_real_secrets(settings: EngineSettings) -> None:
    """Development defaults only go with the embedded database: replicas over a real one must share keys."""
    if not settings.database_url or settings.development:
        return
    shared = {
        "ABADA_JOURNAL_KEYS": settings.journal_keys,
        "ABADA_IDEMPOTENCY_SECRET": settings.idempotency_secret,
        "ABADA_AUTH_TOKENS_FILE": settings.auth_tokens_file,
    }
    missing = [name for name, value in shared.items() if value is None]
    if missing:
        raise SystemExit(
            f"ABADA_DATABASE_URL is set but {', '.join(missing)} is not: every replica must share these. "
            "Set them, or ABADA_DEVELOPMENT=1 to use generated development values."
        )


def _callers_file(settings: EngineSettings) -> pathlib.Path:
    if settings.auth_tokens_file is not None:
        return settings.auth_tokens_file
    directory = settings.state_dir / "dev-tokens"
    registry = write_dev_callers(directory)
    log.warning(
        "ABADA_AUTH_TOKENS_FILE is not set: using development callers; their tokens are in %s "
        "(operator.token, approver.token, worker.token, broker.token)",
        directory,
    )
    return registry


def _server_tls(settings: EngineSettings) -> ServerTls | None:
    cert, key, ca = settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise SystemExit(
            "TLS needs ABADA_TLS_CERT_FILE and ABADA_TLS_KEY_FILE together "
            "(and ABADA_TLS_CLIENT_CA_FILE for client certificates)"
        )
    # Without a client CA: TLS, and callers show who they are by bearer token only.
    return ServerTls(cert.read_bytes(), key.read_bytes(), ca.read_bytes() if ca else None)


async def migrate_only(settings: EngineSettings) -> None:
    url, _embedded = _database_url(settings)
    db = create_engine(url, 1)
    await _require(db, url, settings)
    await migrate(db)
    await db.dispose()
    log.info("migrations applied")


async def reseal(settings: EngineSettings, dry_run: bool, batch_size: int, force: bool = False) -> None:
    """Seal every journal value at rest again under the primary key; print what was found and done."""
    keys = _existing_journal_keys(settings)
    url, _embedded = _database_url(settings)
    db = create_engine(url, 2)
    await _require(db, url, settings)
    try:
        # Only journal keys are used: the idempotency secret derives nothing here.
        sealer = StepSealer(keys, IdempotencyKeys(b"unused"))
        report = await Resealer(db, sealer, batch_size).run(dry_run=dry_run, force=force)
    finally:
        await db.dispose()
    for line in report.lines(keys):
        print(line)
    if report.refused:
        raise SystemExit(2)
    if not dry_run and not report.done:
        raise SystemExit(1)


def _existing_journal_keys(settings: EngineSettings) -> KeyRing:
    """The engines' key ring, never a generated one: sealing under a key no engine has would lose the journal."""
    text = os.environ.get("ABADA_JOURNAL_KEYS", "").strip()
    kept = settings.state_dir / "journal-keys"
    if not text and kept.exists():
        text = kept.read_text().strip()
    if not text:
        raise SystemExit(
            "abada-engine reseal: set ABADA_JOURNAL_KEYS to the engines' key ring (the new key first)"
        )
    try:
        return KeyRing.parse(text)
    except ValueError as error:
        raise SystemExit(f"abada-engine reseal: {error}") from None


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="abada-engine",
        description=__doc__,
        epilog=EngineSettings.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {metadata.version('abada-engine')}")
    commands = parser.add_subparsers(dest="command", metavar="{serve,migrate,reseal}")
    commands.add_parser("serve", help="serve the engine (the default)")
    commands.add_parser("migrate", help="apply the database migrations and stop")
    # Started by `serve` (due_time_process.py), not by hand: so not listed among the commands.
    commands.add_parser(DUE_TIME_PROCESS).add_argument("--parent", type=int, required=True)
    resealing = commands.add_parser(
        "reseal",
        help="seal every journal value at rest again under the first key of ABADA_JOURNAL_KEYS",
        description="Seal every journal value at rest again under the first key of ABADA_JOURNAL_KEYS and "
        "the current associated data, in short batches beside running engines; then a key nothing is "
        "sealed under any more may leave the ring. Safe to stop and run again.",
    )
    resealing.add_argument(
        "--dry-run", action="store_true", help="count what would be re-sealed, change nothing"
    )
    resealing.add_argument(
        "--force",
        action="store_true",
        help="re-seal even though the newest journal step is not sealed under the first key of the ring",
    )
    resealing.add_argument(
        "--batch-size", type=_batch_size, default=200, help="rows per transaction (1-10000)"
    )
    args = parser.parse_args()
    try:
        settings = EngineSettings.from_env()
    except SettingsError as error:
        raise SystemExit(f"abada-engine: {error}") from None
    configure_logging(JsonFormatter("engine"), settings.log_level)
    configure_tracing("abada-engine")
    if args.command == "reseal":
        run(reseal(settings, args.dry_run, args.batch_size, args.force), settings.event_loop)
        return
    if args.command == DUE_TIME_PROCESS:
        if not settings.database_url:
            raise SystemExit(f"abada-engine {DUE_TIME_PROCESS}: ABADA_DATABASE_URL is not set")
        with contextlib.suppress(KeyboardInterrupt):
            due_times = fire_due_times(settings.database_url, args.parent, settings.due_time_process_niceness)
            run(due_times, settings.event_loop)
        return
    with contextlib.suppress(KeyboardInterrupt):
        run(migrate_only(settings) if args.command == "migrate" else serve(settings), settings.event_loop)


def _batch_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError("must be from 1 to 10000")
    return value


def run(main: Coroutine[Any, Any, None], event_loop: str = "uvloop") -> None:
    """On uvloop unless ABADA_EVENT_LOOP=asyncio: its loop costs less per gRPC call and per statement."""
    if event_loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


if __name__ == "__main__":
    main()
