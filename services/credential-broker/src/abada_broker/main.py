"""`abada-broker`: serve tool-server credentials (`serve`, the default), or prepare caller tokens.

abada-broker [serve] [--address HOST:PORT] [--engine HOST:PORT] [--auth-tokens-file FILE] ...
abada-broker dev-tokens --out DIR [--force]
abada-broker hash-token < token-file
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from abada_common.telemetry import configure_tracing
from abada_sdk.connection import ConnectionConfigError

from .auth import CallersFileError, hash_token
from .config import BrokerSettings, ConfigError
from .dev_tokens import DEFAULT_ENGINE_IDENTITY, DEFAULT_WORKER_IDENTITY, DevTokensExist, write_dev_tokens
from .logs import configure_logging
from .origins import OriginsFileError
from .secret_store import SecretBackendSettings, SecretStoreConfigError, VaultSettings
from .server import start_broker

log = logging.getLogger("abada_broker")

_COMMANDS = ("serve", "dev-tokens", "hash-token")
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="abada-broker",
        description="Abada's credential broker: tool-server secrets, only for the holder of a live lease.",
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {metadata.version('abada-credential-broker')}"
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve",
        help="serve CredentialService over gRPC (the default command)",
        epilog=BrokerSettings.describe()
        + "\n\nthe secret store's "
        + SecretBackendSettings.describe()
        + "\n\nwith ABADA_SECRET_BACKEND=vault, "
        + VaultSettings.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "--address", dest="grpc_address", help="listen on HOST:PORT (ABADA_BROKER_GRPC_ADDRESS)"
    )
    serve.add_argument(
        "--tls-cert-file", type=Path, help="TLS on the listener: its certificate (ABADA_BROKER_TLS_CERT_FILE)"
    )
    serve.add_argument("--tls-key-file", type=Path, help="and its private key (ABADA_BROKER_TLS_KEY_FILE)")
    serve.add_argument(
        "--tls-client-ca-file",
        type=Path,
        help="require client certificates signed by this CA (mTLS) (ABADA_BROKER_TLS_CLIENT_CA_FILE)",
    )
    serve.add_argument(
        "--http-address",
        help="HOST:PORT serving the credential API as HTTP/JSON, same TLS (ABADA_BROKER_HTTP_ADDRESS)",
    )
    serve.add_argument(
        "--health-address",
        help="a plaintext HOST:PORT serving grpc.health.v1 only, for probes (ABADA_BROKER_HEALTH_ADDRESS)",
    )
    serve.add_argument(
        "--engine", dest="engine_address", help="the engine's HOST:PORT (ABADA_ENGINE_ADDRESS)"
    )
    serve.add_argument(
        "--engine-token-file",
        type=Path,
        help="the broker's token towards the engine (ABADA_ENGINE_TOKEN_FILE)",
    )
    serve.add_argument(
        "--auth-tokens-file", type=Path, help="the callers' hashed tokens (ABADA_BROKER_AUTH_TOKENS_FILE)"
    )
    serve.add_argument(
        "--credential-origins-file",
        type=Path,
        help="YAML credential-name: [https://host:port, ...]: where each credential may be sent; "
        "unset, loopback servers only (ABADA_BROKER_CREDENTIAL_ORIGINS_FILE)",
    )
    serve.add_argument(
        "--insecure-dev",
        action="store_true",
        default=None,
        help="accept every caller as worker and engine, without a token (ABADA_BROKER_INSECURE_DEV=1)",
    )
    serve.add_argument("--secret-backend", choices=("vault", "file"), help="(ABADA_SECRET_BACKEND)")
    serve.add_argument("--secrets-file", type=Path, help="the file backend's secrets (ABADA_SECRETS_FILE)")
    serve.add_argument(
        "--max-ttl-seconds",
        type=float,
        help="the longest a credential is valid, lease permitting (ABADA_CREDENTIAL_MAX_TTL_SECONDS, 300)",
    )
    serve.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (ABADA_LOG_LEVEL)")
    serve.add_argument(
        "--ready-file",
        type=Path,
        help="once listening, write {address, port, pid} as JSON here (ABADA_BROKER_READY_FILE)",
    )

    dev = commands.add_parser(
        "dev-tokens", help="write a callers file plus plaintext tokens for a worker pool and the engine"
    )
    dev.add_argument("--out", type=Path, required=True, help="the directory to write into")
    dev.add_argument("--worker-identity", default=DEFAULT_WORKER_IDENTITY)
    dev.add_argument("--engine-identity", default=DEFAULT_ENGINE_IDENTITY)
    dev.add_argument("--force", action="store_true", help="replace tokens already in the directory")

    commands.add_parser(
        "hash-token",
        help="print the token_sha256 of the token read from standard input, for the callers file",
    )
    return parser


def _arguments(argv: Sequence[str]) -> argparse.Namespace:
    arguments = list(argv)
    if not arguments or (arguments[0] not in _COMMANDS and arguments[0] not in ("-h", "--help", "--version")):
        arguments.insert(0, "serve")
    return _parser().parse_args(arguments)


def _reachable_host(listen_address: str) -> str:
    host = listen_address.rsplit(":", 1)[0]
    # A wildcard listener is reached on loopback from the same machine.
    return "127.0.0.1" if host in ("", "0.0.0.0", "[::]", "::") else host


def _write_ready_file(
    path: Path,
    listen_address: str,
    port: int,
    health_address: str | None,
    health_port: int | None,
    http_address: str | None = None,
    http_port: int | None = None,
) -> None:
    ready: dict[str, object] = {
        "address": f"{_reachable_host(listen_address)}:{port}",
        "port": port,
        "pid": os.getpid(),
    }
    if health_address is not None and health_port is not None:
        ready["health_address"] = f"{_reachable_host(health_address)}:{health_port}"
        ready["health_port"] = health_port
    if http_address is not None and http_port is not None:
        ready["http_address"] = f"{_reachable_host(http_address)}:{http_port}"
        ready["http_port"] = http_port
    content = json.dumps(ready)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(content)
    os.replace(temporary, path)


async def serve(settings: BrokerSettings) -> None:
    running = await start_broker(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    if settings.ready_file is not None:
        _write_ready_file(
            settings.ready_file,
            settings.grpc_address,
            running.port,
            settings.health_address,
            running.health_port,
            settings.http_address,
            running.http.port if running.http is not None else None,
        )
    await stop.wait()
    log.info("credential broker stopping")
    await running.stop()
    log.info("credential broker stopped")


def _serve_command(arguments: argparse.Namespace) -> int:
    overrides = {
        name: getattr(arguments, name)
        for name in (
            "grpc_address",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
            "health_address",
            "http_address",
            "engine_address",
            "engine_token_file",
            "auth_tokens_file",
            "credential_origins_file",
            "insecure_dev",
            "secret_backend",
            "secrets_file",
            "max_ttl_seconds",
            "log_level",
            "ready_file",
        )
    }
    if overrides["log_level"]:
        overrides["log_level"] = overrides["log_level"].upper()
    level = (overrides["log_level"] or os.environ.get("ABADA_LOG_LEVEL") or "INFO").upper()
    configure_logging(level if level in logging.getLevelNamesMapping() else "INFO")
    configure_tracing("abada-broker")
    try:
        settings = BrokerSettings.from_env(**overrides)
        asyncio.run(serve(settings))
    except (
        ConfigError,
        CallersFileError,
        ConnectionConfigError,
        OriginsFileError,
        SecretStoreConfigError,
        OSError,
    ) as error:
        log.error("the credential broker cannot start: %s", error, extra={"error_type": type(error).__name__})
        return EXIT_CONFIG
    except KeyboardInterrupt:
        pass
    return 0


def _dev_tokens_command(arguments: argparse.Namespace) -> int:
    try:
        written = write_dev_tokens(
            arguments.out,
            worker_identity=arguments.worker_identity,
            engine_identity=arguments.engine_identity,
            overwrite=arguments.force,
        )
    except (DevTokensExist, CallersFileError, OSError) as error:
        print(f"abada-broker dev-tokens: {error}", file=sys.stderr)
        return EXIT_CONFIG
    print(written.describe())
    return 0


def _hash_token_command() -> int:
    token = sys.stdin.read().strip()
    if not token:
        print("abada-broker hash-token: no token on standard input", file=sys.stderr)
        return EXIT_CONFIG
    print(hash_token(token))
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    arguments = _arguments(sys.argv[1:] if argv is None else argv)
    if arguments.command == "dev-tokens":
        status = _dev_tokens_command(arguments)
    elif arguments.command == "hash-token":
        status = _hash_token_command()
    else:
        status = _serve_command(arguments)
    sys.exit(status)


if __name__ == "__main__":
    main()
