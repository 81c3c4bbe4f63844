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
from importlib import metadata
from pathlib import Path
from typing import Self

from abada_common.settings import LogLevel, ServiceSettings, SettingsError, variable
from pydantic import field_validator, model_validator

from .fault import ENV as FAULT_ENV
from .fault import FaultPlan


class WorkerSettings(ServiceSettings):
    engine_address: str = variable("ABADA_ENGINE_ADDRESS", "127.0.0.1:50051", "the engine (host:port)")
    broker_address: str = variable(
        "ABADA_BROKER_ADDRESS", "127.0.0.1:50061", "the credential broker (host:port)"
    )
    worker_id: str = variable("ABADA_WORKER_ID", "", "this worker's identity; unset: hostname-pid")
    token: str | None = variable(
        "ABADA_WORKER_TOKEN", None, "the worker's bearer token (environment only, never a flag)", repr=False
    )
    token_file: Path | None = variable(
        "ABADA_WORKER_TOKEN_FILE", None, "or a file holding it, re-read when it changes"
    )
    topic: str = variable("ABADA_WORKER_TOPIC", "abada:agent", "the topic to serve")
    concurrency: int = variable(
        "ABADA_WORKER_CONCURRENCY", 10, "tasks at once", accepts="a whole number of at least 1", ge=1
    )
    lease_ms: int = variable("ABADA_LEASE_MS", 30_000, "lease length in milliseconds", ge=1_000, le=3_600_000)
    drain_seconds: float = variable(
        "ABADA_DRAIN_SECONDS",
        25.0,
        "grace period after SIGTERM",
        accepts="a number of seconds, 0 or more",
        ge=0,
    )
    health_address: str = variable(
        "ABADA_WORKER_HEALTH_ADDRESS", "127.0.0.1:8081", "host:port for GET /healthz and /metrics"
    )
    gemini_api_key: str | None = variable("GEMINI_API_KEY", None, "the Gemini API key", repr=False)
    gemini_api_key_file: Path | None = variable(
        "ABADA_GEMINI_API_KEY_FILE", None, "a file holding the Gemini API key (wins over GEMINI_API_KEY)"
    )
    gemini_base_url: str | None = variable(
        "ABADA_GEMINI_BASE_URL", None, "a Gemini-compatible endpoint, e.g. the scripted one"
    )
    openai_api_key: str | None = variable("OPENAI_API_KEY", None, "the OpenAI API key", repr=False)
    openai_api_key_file: Path | None = variable(
        "ABADA_OPENAI_API_KEY_FILE", None, "a file holding the OpenAI API key (wins over OPENAI_API_KEY)"
    )
    openai_base_url: str | None = variable(
        "ABADA_OPENAI_BASE_URL", None, "an OpenAI-compatible endpoint", also="OPENAI_BASE_URL"
    )
    anthropic_api_key: str | None = variable("ANTHROPIC_API_KEY", None, "the Anthropic API key", repr=False)
    anthropic_api_key_file: Path | None = variable(
        "ABADA_ANTHROPIC_API_KEY_FILE",
        None,
        "a file holding the Anthropic API key (wins over ANTHROPIC_API_KEY)",
    )
    anthropic_base_url: str | None = variable(
        "ABADA_ANTHROPIC_BASE_URL", None, "an Anthropic-compatible endpoint", also="ANTHROPIC_BASE_URL"
    )
    poll_wait_ms: int = variable("ABADA_WORKER_POLL_WAIT_MS", 10_000, "long-poll wait in milliseconds")
    tool_timeout_seconds: float = variable("ABADA_TOOL_TIMEOUT_SECONDS", 60.0, "per MCP call")
    # A model turn's function calls that run at once, per task.
    tool_call_concurrency: int = variable(
        "ABADA_TOOL_CALL_CONCURRENCY",
        4,
        "function calls of one model turn run at once, per task; 1 runs them one by one",
        accepts="a whole number of at least 1",
        ge=1,
    )
    model_timeout_seconds: float = variable("ABADA_MODEL_TIMEOUT_SECONDS", 120.0, "per model call")
    max_backoff_seconds: float = variable(
        "ABADA_WORKER_MAX_BACKOFF_SECONDS", 10.0, "longest wait between polls while the engine is down"
    )
    log_level: LogLevel = variable("ABADA_LOG_LEVEL", "INFO", "the least severe log lines written")
    # TLS to the engine (the chart's names): a CA to trust, and a client certificate for mTLS.
    tls_ca_file: Path | None = variable("ABADA_TLS_CA_FILE", None, "CA bundle for TLS to the engine")
    tls_cert_file: Path | None = variable(
        "ABADA_TLS_CERT_FILE", None, "client certificate for mTLS to the engine"
    )
    tls_key_file: Path | None = variable("ABADA_TLS_KEY_FILE", None, "its private key")
    # TLS to the credential broker: its CA turns TLS on; a client certificate adds mTLS.
    broker_tls_ca_file: Path | None = variable(
        "ABADA_BROKER_TLS_CA_FILE",
        None,
        "CA bundle for TLS to the broker; set, the broker is dialed over TLS",
    )
    broker_tls_cert_file: Path | None = variable(
        "ABADA_BROKER_TLS_CERT_FILE", None, "client certificate for mTLS to the broker"
    )
    broker_tls_key_file: Path | None = variable("ABADA_BROKER_TLS_KEY_FILE", None, "its private key")
    fault_plan: str | None = variable(FAULT_ENV, None, "tests only: kill the worker at a planned point")

    @field_validator("fault_plan")
    @classmethod
    def _parses(cls, value: str | None) -> str | None:
        FaultPlan.parse(value)  # its ValueError names the variable and the forms it takes
        return value

    @property
    def fault(self) -> FaultPlan:
        return FaultPlan.parse(self.fault_plan)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        if (self.broker_tls_cert_file is None) != (self.broker_tls_key_file is None):
            raise ValueError("--broker-tls-cert-file and --broker-tls-key-file go together")
        if self.broker_tls_cert_file is not None and self.broker_tls_ca_file is None:
            # Without the CA the broker would be dialed in plaintext and the certificate never shown.
            raise ValueError("--broker-tls-cert-file needs --broker-tls-ca-file (ABADA_BROKER_TLS_CA_FILE)")
        return self


# The flags, each overriding the field of the same name.
_FLAGS = (
    "engine_address",
    "broker_address",
    "worker_id",
    "token_file",
    "topic",
    "concurrency",
    "lease_ms",
    "drain_seconds",
    "health_address",
    "gemini_base_url",
    "gemini_api_key_file",
    "openai_base_url",
    "openai_api_key_file",
    "anthropic_base_url",
    "anthropic_api_key_file",
    "poll_wait_ms",
    "tool_timeout_seconds",
    "tool_call_concurrency",
    "model_timeout_seconds",
    "max_backoff_seconds",
    "tls_ca_file",
    "tls_cert_file",
    "tls_key_file",
    "broker_tls_ca_file",
    "broker_tls_cert_file",
    "broker_tls_key_file",
    "log_level",
)


def _parser() -> argparse.ArgumentParser:
    # No abbreviations: `--token x` must not quietly become `--token-file x`.
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="abada-worker",
        description="Abada agent worker: runs agent nodes (topic abada:agent) with MCP tools. A flag wins "
        "over its variable, which wins over the default.",
        epilog=WorkerSettings.describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--version", action="version", version=f"%(prog)s {metadata.version('abada-agent-worker')}")
    add(
        "--engine-address",
        help="host:port (ABADA_ENGINE_ADDRESS)",
    )
    add(
        "--broker-address",
        help="host:port (ABADA_BROKER_ADDRESS)",
    )
    add(
        "--worker-id",
        help="this worker's identity; default hostname-pid (ABADA_WORKER_ID)",
    )
    add(
        "--token-file",
        type=Path,
        help="file holding the bearer token, re-read when it changes (ABADA_WORKER_TOKEN_FILE); ABADA_WORKER_TOKEN sets the token itself",
    )
    add(
        "--topic",
        help="topic to serve (ABADA_WORKER_TOPIC)",
    )
    add(
        "--concurrency",
        type=int,
        help="tasks at once (ABADA_WORKER_CONCURRENCY)",
    )
    add(
        "--lease-ms",
        type=int,
        help="lease length (ABADA_LEASE_MS)",
    )
    add(
        "--drain-seconds",
        type=float,
        help="grace period after SIGTERM (ABADA_DRAIN_SECONDS)",
    )
    add(
        "--health-address",
        help="host:port for GET /healthz (ABADA_WORKER_HEALTH_ADDRESS)",
    )
    add(
        "--gemini-base-url",
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
                help=f"a {provider}-compatible endpoint (ABADA_{upper}_BASE_URL, else {sdk_base_variable})",
            )
        add(
            f"--{provider}-api-key-file",
            type=Path,
            help=f"file holding the {provider} API key (ABADA_{upper}_API_KEY_FILE); {key_variable} sets the key itself",
        )
    add(
        "--poll-wait-ms",
        type=int,
        help="long-poll wait (ABADA_WORKER_POLL_WAIT_MS)",
    )
    add(
        "--tool-timeout-seconds",
        type=float,
        help="per MCP call (ABADA_TOOL_TIMEOUT_SECONDS)",
    )
    add(
        "--tool-call-concurrency",
        type=int,
        help="function calls of one model turn run at once, per task; 1 runs them one by one "
        "(ABADA_TOOL_CALL_CONCURRENCY)",
    )
    add(
        "--model-timeout-seconds",
        type=float,
        help="per model call (ABADA_MODEL_TIMEOUT_SECONDS)",
    )
    add(
        "--max-backoff-seconds",
        type=float,
        help="longest wait between polls while the engine is down (ABADA_WORKER_MAX_BACKOFF_SECONDS)",
    )
    add(
        "--tls-ca-file",
        type=Path,
        help="CA bundle for TLS to the engine (ABADA_TLS_CA_FILE)",
    )
    add(
        "--tls-cert-file",
        type=Path,
        help="client certificate for mTLS to the engine (ABADA_TLS_CERT_FILE)",
    )
    add(
        "--tls-key-file",
        type=Path,
        help="its private key (ABADA_TLS_KEY_FILE)",
    )
    add(
        "--broker-tls-ca-file",
        type=Path,
        help="CA bundle for TLS to the broker; set, the broker is dialed over TLS (ABADA_BROKER_TLS_CA_FILE)",
    )
    add(
        "--broker-tls-cert-file",
        type=Path,
        help="client certificate for mTLS to the broker (ABADA_BROKER_TLS_CERT_FILE)",
    )
    add(
        "--broker-tls-key-file",
        type=Path,
        help="its private key (ABADA_BROKER_TLS_KEY_FILE)",
    )
    add("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL (ABADA_LOG_LEVEL)")
    return parser


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> WorkerSettings:
    environment = dict(os.environ if env is None else env)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        settings = WorkerSettings.from_env(environment, **{name: getattr(args, name) for name in _FLAGS})
    except SettingsError as error:
        parser.error(str(error))
    return settings.model_copy(
        update={
            "worker_id": settings.worker_id or f"{socket.gethostname()}-{os.getpid()}",
            "gemini_api_key": _api_key(parser, settings.gemini_api_key, settings.gemini_api_key_file),
            "openai_api_key": _api_key(parser, settings.openai_api_key, settings.openai_api_key_file),
            "anthropic_api_key": _api_key(
                parser, settings.anthropic_api_key, settings.anthropic_api_key_file
            ),
        }
    )


def _api_key(parser: argparse.ArgumentParser, key: str | None, file: Path | None) -> str | None:
    """The key from its file when one is named (a mounted secret), else from the environment."""
    if file is not None:
        try:
            return file.read_text(encoding="utf-8").strip() or None
        except OSError as error:
            parser.error(f"cannot read the API key file {file}: {error.strerror}")
    return key
