"""Engine settings: every ABADA_* variable the engine reads, typed and described (`abada-engine --help`).

A bad value stops the engine with one line naming the variable and what it accepts, never a
traceback: `SettingsError` carries that line and `main` prints it. The journal keys, the
idempotency secret and the deploy-time credential variables are declared here too (listed and
type-checked); `runtime/crypto/keys.py` and `definitions/tool_contracts.py` read and check their contents.
"""

from __future__ import annotations

import pathlib
from typing import Literal

from abada_common.settings import LogLevel, ServiceSettings, variable
from abada_common.settings import SettingsError as SettingsError  # what `main` catches
from pydantic import SecretStr

EXTRA_PROCESS = "ABADA_ENGINE_EXTRA_PROCESS"


class EngineSettings(ServiceSettings):
    database_url: str | None = variable(
        "ABADA_DATABASE_URL",
        None,
        "PostgreSQL (postgresql://…); unset: an embedded pgserver in $ABADA_STATE_DIR/pgdata",
    )
    grpc_address: str = variable("ABADA_GRPC_ADDRESS", "127.0.0.1:50051", "where gRPC listens (host:port)")
    http_address: str = variable(
        "ABADA_HTTP_ADDRESS",
        "127.0.0.1:8080",
        "where HTTP listens: the API as HTTP/JSON, /healthz, /metrics, queue stats",
    )
    # The HTTP port is plain HTTP: where bearer tokens must not cross a network in clear (the gRPC
    # port has TLS, this one has not), the API can stay off it, leaving health and figures.
    http_api: bool = variable(
        "ABADA_HTTP_API", True, "serve every RPC as HTTP/JSON on the HTTP port (0: only health and figures)"
    )
    state_dir: pathlib.Path = variable(
        "ABADA_STATE_DIR",
        pathlib.Path(".abada"),
        "development state: the embedded database, generated keys and callers",
    )
    log_level: LogLevel = variable("ABADA_LOG_LEVEL", "INFO", "the least severe log lines written")
    db_pool_size: int = variable(
        "ABADA_DB_POOL_SIZE", 20, "PostgreSQL connections in all, per engine process", ge=1, le=1_000
    )
    # Engine processes serving one gRPC port (SO_REUSEPORT): one per core on a bigger machine.
    processes: int = variable(
        "ABADA_ENGINE_PROCESSES",
        1,
        "engine processes on the one gRPC port (SO_REUSEPORT); the first alone migrates and serves HTTP",
        ge=1,
        le=256,
    )
    # Set in the extra processes the first one starts: they serve gRPC only.
    extra_process: bool = variable(
        EXTRA_PROCESS, False, "set by the engine itself in the extra processes it starts", accepts="1 or 0"
    )
    deploy_mcp_timeout_seconds: float = variable(
        "ABADA_DEPLOY_MCP_TIMEOUT_SECONDS",
        10.0,
        "how long deploy waits for a tool server",
        accepts="a positive number of seconds (e.g. 10 or 2.5)",
        gt=0,
        allow_inf_nan=False,
    )
    development: bool = variable(
        "ABADA_DEVELOPMENT",
        False,
        "1 allows generated development keys and callers with ABADA_DATABASE_URL set",
    )
    event_loop: Literal["uvloop", "asyncio"] = variable(
        "ABADA_EVENT_LOOP", "uvloop", "uvloop, or asyncio for the standard event loop"
    )
    auth_tokens_file: pathlib.Path | None = variable(
        "ABADA_AUTH_TOKENS_FILE",
        None,
        "the callers: identity, roles, topics, token_sha256 or certificate_cn; unset: development callers "
        "in $ABADA_STATE_DIR/dev-tokens",
    )
    tls_cert_file: pathlib.Path | None = variable(
        "ABADA_TLS_CERT_FILE", None, "mTLS on the gRPC port: the server certificate"
    )
    tls_key_file: pathlib.Path | None = variable("ABADA_TLS_KEY_FILE", None, "and its private key")
    tls_client_ca_file: pathlib.Path | None = variable(
        "ABADA_TLS_CLIENT_CA_FILE",
        None,
        "the CA of client certificates (a caller's identity is its CN); unset with a certificate: TLS, tokens only",
    )
    journal_keys: SecretStr | None = variable(
        "ABADA_JOURNAL_KEYS",
        None,
        "id:base64key,… AES-256 keys: the first seals, all open; unset: a generated development key",
    )
    idempotency_secret: SecretStr | None = variable(
        "ABADA_IDEMPOTENCY_SECRET",
        None,
        "HMAC secret for idempotency keys, at least 32 bytes, the same on every replica",
    )
    broker_address: str | None = variable(
        "ABADA_BROKER_ADDRESS", None, "the credential broker (host:port) for deploy-time tool credentials"
    )
    broker_token_file: pathlib.Path | None = variable(
        "ABADA_BROKER_TOKEN_FILE", None, "the engine's token towards the broker"
    )
    broker_tls_ca_file: pathlib.Path | None = variable(
        "ABADA_BROKER_TLS_CA_FILE", None, "CA for TLS to the broker; set, the broker is dialed over TLS"
    )
    broker_tls_cert_file: pathlib.Path | None = variable(
        "ABADA_BROKER_TLS_CERT_FILE", None, "client certificate for mTLS to the broker"
    )
    broker_tls_key_file: pathlib.Path | None = variable("ABADA_BROKER_TLS_KEY_FILE", None, "its private key")
    deploy_credentials_file: pathlib.Path | None = variable(
        "ABADA_DEPLOY_CREDENTIALS_FILE", None, "or deploy-time credentials from a YAML file name: value"
    )
    # Firing due times is background work in bursts: in a process of its own, at a lower CPU priority,
    # it leaves the serving process's event loop and the CPU to the calls (`due_time_process.py`).
    due_time_process: bool = variable(
        "ABADA_DUE_TIME_PROCESS",
        True,
        "fire timers, timeouts and deadlines and match buffered messages in a child process (0: in this one)",
        accepts="1 or 0",
    )
    due_time_process_niceness: int = variable(
        "ABADA_DUE_TIME_PROCESS_NICENESS",
        10,
        "how much lower the due-time process's CPU priority is than the serving process's (nice)",
        ge=0,
        le=19,
    )
    # Any replica may run the retention job (one at a time); 0 leaves it to the others.
    retention_round_seconds: float = variable(
        "ABADA_RETENTION_ROUND_SECONDS",
        30.0,
        "how often this replica looks for finished instances past their retention (0: never)",
        accepts="a number of seconds >= 0",
        ge=0,
        allow_inf_nan=False,
    )
    # Every replica works through batches (each claims other instances); 0 leaves it to the others.
    batch_round_seconds: float = variable(
        "ABADA_BATCH_ROUND_SECONDS",
        1.0,
        "how often this replica looks for batch operations to work on (0: never)",
        accepts="a number of seconds >= 0",
        ge=0,
        allow_inf_nan=False,
    )
