"""Worker settings: every one from a command-line flag, else the environment, else a default.

Secrets (the worker's bearer token, the model providers' API keys) come from the environment or
a file only, never from flags, so they do not show up in process listings.

Model providers: a provider is served when it has a key or an endpoint. Keys: GEMINI_API_KEY,
OPENAI_API_KEY, ANTHROPIC_API_KEY, or a file named by `--<provider>-api-key-file`. Endpoints:
`--<provider>-base-url` / ABADA_<PROVIDER>_BASE_URL, else the SDKs' own OPENAI_BASE_URL and
ANTHROPIC_BASE_URL (any OpenAI-compatible server: Azure OpenAI, vLLM, Ollama, a gateway).
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from .fault import ENV as FAULT_ENV
from .fault import FaultPlan


@dataclass(frozen=True)
class WorkerSettings:
    engine_address: str = "127.0.0.1:50051"
    broker_address: str = "127.0.0.1:50061"
    worker_id: str = ""
    token: str | None = None
    token_file: Path | None = None
    topic: str = "abada:agent"
    concurrency: int = 10
    lease_ms: int = 30_000
    drain_seconds: float = 25.0
    health_address: str = "127.0.0.1:8081"
    gemini_api_key: str | None = None
    gemini_base_url: str | None = None
    openai_api_key: str | None = None
    openai_base_url: str | None = None
    anthropic_api_key: str | None = None
    anthropic_base_url: str | None = None
    poll_wait_ms: int = 10_000
    tool_timeout_seconds: float = 60.0
    # A model turn's function calls that run at once, per task.
    tool_call_concurrency: int = 4
    model_timeout_seconds: float = 120.0
    max_backoff_seconds: float = 10.0
    log_level: str = "INFO"
    # TLS to the engine (the chart's names): a CA to trust, and a client certificate for mTLS.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # TLS to the credential broker: its CA turns TLS on; a client certificate adds mTLS.
    broker_tls_ca_file: Path | None = None
    broker_tls_cert_file: Path | None = None
    broker_tls_key_file: Path | None = None
    fault: FaultPlan = field(default_factory=FaultPlan)


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    defaults = WorkerSettings()

    def default(name: str, fallback: object) -> object:
        return env.get(name) or fallback

    # No abbreviations: `--token x` must not quietly become `--token-file x`.
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="abada-worker",
        description="Abada agent worker: runs agent nodes (topic abada:agent) with MCP tools.",
    )
    add = parser.add_argument
    add("--version", action="version", version=f"%(prog)s {metadata.version('abada-agent-worker')}")
    add(
        "--engine-address",
        default=default("ABADA_ENGINE_ADDRESS", defaults.engine_address),
        help="host:port (ABADA_ENGINE_ADDRESS)",
    )
    add(
        "--broker-address",
        default=default("ABADA_BROKER_ADDRESS", defaults.broker_address),
        help="host:port (ABADA_BROKER_ADDRESS)",
    )
    add(
        "--worker-id",
        default=default("ABADA_WORKER_ID", ""),
        help="this worker's identity; default hostname-pid (ABADA_WORKER_ID)",
    )
    add(
        "--token-file",
        type=Path,
        default=default("ABADA_WORKER_TOKEN_FILE", None),
        help="file holding the bearer token, re-read when it changes (ABADA_WORKER_TOKEN_FILE); ABADA_WORKER_TOKEN sets the token itself",
    )
    add(
        "--topic",
        default=default("ABADA_WORKER_TOPIC", defaults.topic),
        help="topic to serve (ABADA_WORKER_TOPIC)",
    )
    add(
        "--concurrency",
        type=int,
        default=default("ABADA_WORKER_CONCURRENCY", defaults.concurrency),
        help="tasks at once (ABADA_WORKER_CONCURRENCY)",
    )
    add(
        "--lease-ms",
        type=int,
        default=default("ABADA_LEASE_MS", defaults.lease_ms),
        help="lease length (ABADA_LEASE_MS)",
    )
    add(
        "--drain-seconds",
        type=float,
        default=default("ABADA_DRAIN_SECONDS", defaults.drain_seconds),
        help="grace period after SIGTERM (ABADA_DRAIN_SECONDS)",
    )
    add(
        "--health-address",
        default=default("ABADA_WORKER_HEALTH_ADDRESS", defaults.health_address),
        help="host:port for GET /healthz (ABADA_WORKER_HEALTH_ADDRESS)",
    )
    add(
        "--gemini-base-url",
        default=default("ABADA_GEMINI_BASE_URL", None),
        help="a Gemini-compatible endpoint, e.g. the scripted one (ABADA_GEMINI_BASE_URL); GEMINI_API_KEY is read from the environment",
    )
    for provider, key_variable, sdk_base_variable in (
        ("gemini", "GEMINI_API_KEY", None),
        ("openai", "OPENAI_API_KEY", "OPENAI_BASE_URL"),
        ("anthropic", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL"),
    ):
        upper = provider.upper()
        if provider != "gemini":
            add(
                f"--{provider}-base-url",
                default=default(f"ABADA_{upper}_BASE_URL", None) or default(sdk_base_variable or "", None),
                help=f"a {provider}-compatible endpoint (ABADA_{upper}_BASE_URL, else {sdk_base_variable})",
            )
        add(
            f"--{provider}-api-key-file",
            type=Path,
            default=default(f"ABADA_{upper}_API_KEY_FILE", None),
            help=f"file holding the {provider} API key (ABADA_{upper}_API_KEY_FILE); {key_variable} sets the key itself",
        )
    add(
        "--poll-wait-ms",
        type=int,
        default=default("ABADA_WORKER_POLL_WAIT_MS", defaults.poll_wait_ms),
        help="long-poll wait (ABADA_WORKER_POLL_WAIT_MS)",
    )
    add(
        "--tool-timeout-seconds",
        type=float,
        default=default("ABADA_TOOL_TIMEOUT_SECONDS", defaults.tool_timeout_seconds),
        help="per MCP call (ABADA_TOOL_TIMEOUT_SECONDS)",
    )
    add(
        "--tool-call-concurrency",
        type=int,
        default=default("ABADA_TOOL_CALL_CONCURRENCY", defaults.tool_call_concurrency),
        help="function calls of one model turn run at once, per task; 1 runs them one by one "
        "(ABADA_TOOL_CALL_CONCURRENCY)",
    )
    add(
        "--model-timeout-seconds",
        type=float,
        default=default("ABADA_MODEL_TIMEOUT_SECONDS", defaults.model_timeout_seconds),
        help="per model call (ABADA_MODEL_TIMEOUT_SECONDS)",
    )
    add(
        "--max-backoff-seconds",
        type=float,
        default=default("ABADA_WORKER_MAX_BACKOFF_SECONDS", defaults.max_backoff_seconds),
        help="longest wait between polls while the engine is down (ABADA_WORKER_MAX_BACKOFF_SECONDS)",
    )
    add(
        "--tls-ca-file",
        type=Path,
        default=default("ABADA_TLS_CA_FILE", None),
        help="CA bundle for TLS to the engine (ABADA_TLS_CA_FILE)",
    )
    add(
        "--tls-cert-file",
        type=Path,
        default=default("ABADA_TLS_CERT_FILE", None),
        help="client certificate for mTLS to the engine (ABADA_TLS_CERT_FILE)",
    )
    add(
        "--tls-key-file",
        type=Path,
        default=default("ABADA_TLS_KEY_FILE", None),
        help="its private key (ABADA_TLS_KEY_FILE)",
    )
    add(
        "--broker-tls-ca-file",
        type=Path,
        default=default("ABADA_BROKER_TLS_CA_FILE", None),
        help="CA bundle for TLS to the broker; set, the broker is dialed over TLS (ABADA_BROKER_TLS_CA_FILE)",
    )
    add(
        "--broker-tls-cert-file",
        type=Path,
        default=default("ABADA_BROKER_TLS_CERT_FILE", None),
        help="client certificate for mTLS to the broker (ABADA_BROKER_TLS_CERT_FILE)",
    )
    add(
        "--broker-tls-key-file",
        type=Path,
        default=default("ABADA_BROKER_TLS_KEY_FILE", None),
        help="its private key (ABADA_BROKER_TLS_KEY_FILE)",
    )
    add("--log-level", default=default("ABADA_LOG_LEVEL", defaults.log_level), help="(ABADA_LOG_LEVEL)")
    return parser


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerSettings:
    environment = dict(os.environ if env is None else env)
    parser = _parser(environment)
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.tool_call_concurrency < 1:
        parser.error("--tool-call-concurrency must be at least 1")
    if not 1_000 <= args.lease_ms <= 3_600_000:
        parser.error("--lease-ms must be between 1000 and 3600000")
    if args.drain_seconds < 0:
        parser.error("--drain-seconds must not be negative")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        parser.error("--tls-cert-file and --tls-key-file go together")
    if (args.broker_tls_cert_file is None) != (args.broker_tls_key_file is None):
        parser.error("--broker-tls-cert-file and --broker-tls-key-file go together")
    if args.broker_tls_cert_file is not None and args.broker_tls_ca_file is None:
        # Without the CA the broker would be dialed in plaintext and the certificate never shown.
        parser.error("--broker-tls-cert-file needs --broker-tls-ca-file (ABADA_BROKER_TLS_CA_FILE)")
    try:
        fault = FaultPlan.parse(environment.get(FAULT_ENV))
    except ValueError as error:
        parser.error(str(error))
    return WorkerSettings(
        engine_address=args.engine_address,
        broker_address=args.broker_address,
        worker_id=args.worker_id or f"{socket.gethostname()}-{os.getpid()}",
        token=environment.get("ABADA_WORKER_TOKEN") or None,
        token_file=Path(args.token_file) if args.token_file else None,
        topic=args.topic,
        concurrency=args.concurrency,
        lease_ms=args.lease_ms,
        drain_seconds=args.drain_seconds,
        health_address=args.health_address,
        gemini_api_key=_api_key(parser, environment, "GEMINI_API_KEY", args.gemini_api_key_file),
        gemini_base_url=args.gemini_base_url or None,
        openai_api_key=_api_key(parser, environment, "OPENAI_API_KEY", args.openai_api_key_file),
        openai_base_url=args.openai_base_url or None,
        anthropic_api_key=_api_key(parser, environment, "ANTHROPIC_API_KEY", args.anthropic_api_key_file),
        anthropic_base_url=args.anthropic_base_url or None,
        poll_wait_ms=args.poll_wait_ms,
        tool_timeout_seconds=args.tool_timeout_seconds,
        tool_call_concurrency=args.tool_call_concurrency,
        model_timeout_seconds=args.model_timeout_seconds,
        max_backoff_seconds=args.max_backoff_seconds,
        log_level=args.log_level,
        tls_ca_file=Path(args.tls_ca_file) if args.tls_ca_file else None,
        tls_cert_file=Path(args.tls_cert_file) if args.tls_cert_file else None,
        tls_key_file=Path(args.tls_key_file) if args.tls_key_file else None,
        broker_tls_ca_file=Path(args.broker_tls_ca_file) if args.broker_tls_ca_file else None,
        broker_tls_cert_file=Path(args.broker_tls_cert_file) if args.broker_tls_cert_file else None,
        broker_tls_key_file=Path(args.broker_tls_key_file) if args.broker_tls_key_file else None,
        fault=fault,
    )


def _api_key(
    parser: argparse.ArgumentParser, environment: Mapping[str, str], variable: str, file: Path | str | None
) -> str | None:
    """The key from its file when one is named (a mounted secret), else from the environment."""
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").strip() or None
        except OSError as error:
            parser.error(f"cannot read the API key file {file}: {error.strerror}")
    return environment.get(variable) or None
