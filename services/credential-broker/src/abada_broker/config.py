"""The broker's settings: environment variables, typed and described (`abada-broker serve --help`), many
overridable by a command-line flag (see main.py).

The secret store reads its own settings (ABADA_SECRET_BACKEND, VAULT_*, ABADA_VAULT_*, ABADA_SECRET_*,
ABADA_SECRETS_FILE) through ``secret_store.secret_store_from_env``, declared in
``SecretBackendSettings`` and ``VaultSettings``; :attr:`BrokerSettings.store_environ`
is the environment it is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self

from abada_common.addresses import is_loopback_host
from abada_common.settings import LogLevel, ServiceSettings, SettingsError, variable
from pydantic import Field, model_validator

DEFAULT_GRPC_ADDRESS = "127.0.0.1:50061"
DEFAULT_ENGINE_ADDRESS = "127.0.0.1:50051"
DEFAULT_MAX_TTL_SECONDS = 300.0
DEFAULT_ENGINE_TIMEOUT_SECONDS = 5.0
DEFAULT_HEALTH_INTERVAL_SECONDS = 10.0


# A bad or missing setting: the message is one line naming the variable.
ConfigError = SettingsError


def _seconds(name: str, default: float, description: str) -> Any:
    return variable(
        name, default, description, accepts="a positive number of seconds", gt=0, allow_inf_nan=False
    )


class BrokerSettings(ServiceSettings):
    grpc_address: str = variable("ABADA_BROKER_GRPC_ADDRESS", DEFAULT_GRPC_ADDRESS, "listen on HOST:PORT")
    # TLS on the listener: a certificate and key, and with a client CA also mTLS (client certificates).
    tls_cert_file: Path | None = variable(
        "ABADA_BROKER_TLS_CERT_FILE", None, "TLS on the listener: its certificate"
    )
    tls_key_file: Path | None = variable("ABADA_BROKER_TLS_KEY_FILE", None, "and its private key")
    tls_client_ca_file: Path | None = variable(
        "ABADA_BROKER_TLS_CLIENT_CA_FILE", None, "require client certificates signed by this CA (mTLS)"
    )
    # A second, plaintext listener serving grpc.health.v1 only, for probes that cannot speak TLS.
    health_address: str | None = variable(
        "ABADA_BROKER_HEALTH_ADDRESS", None, "a plaintext HOST:PORT serving grpc.health.v1 only, for probes"
    )
    # CredentialService as HTTP/JSON (the protos' HTTP rules), with the listener's TLS settings.
    http_address: str | None = variable(
        "ABADA_BROKER_HTTP_ADDRESS",
        None,
        "HOST:PORT serving the credential API as HTTP/JSON (same TLS as the gRPC port); unset: off",
    )
    # Plain HTTP `GET /metrics` for Prometheus; off when unset.
    metrics_address: str | None = variable(
        "ABADA_BROKER_METRICS_ADDRESS", None, "HOST:PORT serving Prometheus GET /metrics; unset: off"
    )
    engine_address: str = variable("ABADA_ENGINE_ADDRESS", DEFAULT_ENGINE_ADDRESS, "the engine's HOST:PORT")
    engine_token: str | None = variable(
        "ABADA_ENGINE_TOKEN", None, "the broker's token towards the engine", accepts="text", repr=False
    )
    engine_token_file: Path | None = variable(
        "ABADA_ENGINE_TOKEN_FILE", None, "or a file holding it, re-read when it changes"
    )
    engine_tls_ca_file: Path | None = variable("ABADA_ENGINE_TLS_CA_FILE", None, "CA for TLS to the engine")
    engine_tls_cert_file: Path | None = variable(
        "ABADA_ENGINE_TLS_CERT_FILE", None, "client certificate for mTLS to the engine"
    )
    engine_tls_key_file: Path | None = variable("ABADA_ENGINE_TLS_KEY_FILE", None, "its private key")
    engine_timeout_seconds: float = _seconds(
        "ABADA_ENGINE_TIMEOUT_SECONDS", DEFAULT_ENGINE_TIMEOUT_SECONDS, "how long VerifyLease may take"
    )
    auth_tokens_file: Path | None = variable(
        "ABADA_BROKER_AUTH_TOKENS_FILE",
        None,
        "the callers' hashed tokens (abada-broker dev-tokens writes one)",
    )
    # Which tool-server origins may receive each credential (origins.py); unset: loopback only.
    credential_origins_file: Path | None = variable(
        "ABADA_BROKER_CREDENTIAL_ORIGINS_FILE",
        None,
        "YAML credential-name: [https://host:port, ...]: where each credential may be sent; unset: loopback only",
    )
    insecure_dev: bool = variable(
        "ABADA_BROKER_INSECURE_DEV", False, "1 accepts every caller as worker and engine, without a token"
    )
    max_ttl_seconds: float = _seconds(
        "ABADA_CREDENTIAL_MAX_TTL_SECONDS",
        DEFAULT_MAX_TTL_SECONDS,
        "the longest a credential is valid, lease permitting",
    )
    health_interval_seconds: float = _seconds(
        "ABADA_BROKER_HEALTH_INTERVAL_SECONDS",
        DEFAULT_HEALTH_INTERVAL_SECONDS,
        "how often the secret store's health is checked",
    )
    log_level: LogLevel = variable("ABADA_LOG_LEVEL", "INFO", "the least severe log lines written")
    ready_file: Path | None = variable(
        "ABADA_BROKER_READY_FILE", None, "once listening, write {address, port, pid} as JSON here"
    )
    # The environment the secret store reads its own settings from (secret_store/), flags applied.
    store_environ: dict[str, str] = Field(default_factory=dict, repr=False, exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not self.insecure_dev and self.auth_tokens_file is None:
            raise ValueError(
                "no caller authentication: set ABADA_BROKER_AUTH_TOKENS_FILE (--auth-tokens-file), "
                "for instance to a file written by `abada-broker dev-tokens --out DIR`; or, on a machine "
                "nobody else can reach, run with --insecure-dev (ABADA_BROKER_INSECURE_DEV=1)"
            )
        if self.engine_token and self.engine_token_file is not None:
            raise ValueError("set ABADA_ENGINE_TOKEN or ABADA_ENGINE_TOKEN_FILE, not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("ABADA_BROKER_TLS_CERT_FILE and ABADA_BROKER_TLS_KEY_FILE go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError(
                "ABADA_BROKER_TLS_CLIENT_CA_FILE needs ABADA_BROKER_TLS_CERT_FILE and "
                "ABADA_BROKER_TLS_KEY_FILE: client certificates are only checked on a TLS listener"
            )
        if (self.engine_tls_cert_file is None) != (self.engine_tls_key_file is None):
            raise ValueError("ABADA_ENGINE_TLS_CERT_FILE and ABADA_ENGINE_TLS_KEY_FILE go together")
        for name in ("grpc_address", "engine_address"):
            address: str = getattr(self, name)
            if not address or ":" not in address:
                raise ValueError(f"{_VARIABLES[name]} must be HOST:PORT, got {address!r}")
        if self.insecure_dev:
            for name in ("grpc_address", "health_address"):
                listen: str | None = getattr(self, name)
                if listen is not None and not _is_loopback_address(listen):
                    raise ValueError(
                        f"--insecure-dev accepts every caller without a token, so it listens on loopback "
                        f"only: {_VARIABLES.get(name, 'ABADA_BROKER_HEALTH_ADDRESS')} is {listen!r}"
                    )
        if self.health_address is not None and ":" not in self.health_address:
            raise ValueError(f"ABADA_BROKER_HEALTH_ADDRESS must be HOST:PORT, got {self.health_address!r}")
        if self.metrics_address is not None and ":" not in self.metrics_address:
            raise ValueError(f"ABADA_BROKER_METRICS_ADDRESS must be HOST:PORT, got {self.metrics_address!r}")
        return self

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def client_certificates_required(self) -> bool:
        return self.tls_client_ca_file is not None

    @property
    def engine_tls_enabled(self) -> bool:
        return self.engine_tls_ca_file is not None or self.engine_tls_cert_file is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """Settings from ``environ`` (default ``os.environ``); ``overrides`` (flags) win over it.

        The flags `secret_backend` and `secrets_file` are the secret store's: they go into
        :attr:`store_environ` as ABADA_SECRET_BACKEND and ABADA_SECRETS_FILE.
        """
        env = dict(os.environ if environ is None else environ)
        store_overrides: dict[str, str] = {}
        settings_overrides: dict[str, Any] = {}
        for name, value in overrides.items():
            if value is None or value is False:
                continue
            if name == "secret_backend":
                store_overrides["ABADA_SECRET_BACKEND"] = str(value)
            elif name == "secrets_file":
                store_overrides["ABADA_SECRETS_FILE"] = str(value)
            elif name in cls.model_fields:
                settings_overrides[name] = value
            else:
                raise ConfigError(f"unknown setting {name!r}")
        return super().from_env(env, store_environ={**env, **store_overrides}, **settings_overrides)


_VARIABLES = {
    "grpc_address": "ABADA_BROKER_GRPC_ADDRESS",
    "engine_address": "ABADA_ENGINE_ADDRESS",
    "max_ttl_seconds": "ABADA_CREDENTIAL_MAX_TTL_SECONDS",
    "engine_timeout_seconds": "ABADA_ENGINE_TIMEOUT_SECONDS",
    "health_interval_seconds": "ABADA_BROKER_HEALTH_INTERVAL_SECONDS",
}


def _is_loopback_address(address: str) -> bool:
    return is_loopback_host(address.rsplit(":", 1)[0])
