"""The broker's settings: environment variables, each overridable by a command-line flag (see main.py).

The secret store reads its own settings (ABADA_SECRET_BACKEND, VAULT_*, ABADA_VAULT_*, ABADA_SECRET_*,
ABADA_SECRETS_FILE) through ``secret_store.secret_store_from_env``; :attr:`BrokerSettings.store_environ`
is the environment it is given.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_GRPC_ADDRESS = "127.0.0.1:50061"
DEFAULT_ENGINE_ADDRESS = "127.0.0.1:50051"
DEFAULT_MAX_TTL_SECONDS = 300.0
DEFAULT_ENGINE_TIMEOUT_SECONDS = 5.0
DEFAULT_HEALTH_INTERVAL_SECONDS = 10.0
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_LEVELS = frozenset({"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"})


class ConfigError(Exception):
    """A setting is missing or malformed; the message names the variable."""


@dataclass(frozen=True, kw_only=True)
class BrokerSettings:
    grpc_address: str = DEFAULT_GRPC_ADDRESS
    # TLS on the listener: a certificate and key, and with a client CA also mTLS (client certificates).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    # A second, plaintext listener serving grpc.health.v1 only, for probes that cannot speak TLS.
    health_address: str | None = None
    # Plain HTTP `GET /metrics` for Prometheus; off when unset.
    metrics_address: str | None = None
    engine_address: str = DEFAULT_ENGINE_ADDRESS
    engine_token: str | None = field(default=None, repr=False)
    engine_token_file: Path | None = None
    engine_tls_ca_file: Path | None = None
    engine_tls_cert_file: Path | None = None
    engine_tls_key_file: Path | None = None
    engine_timeout_seconds: float = DEFAULT_ENGINE_TIMEOUT_SECONDS
    auth_tokens_file: Path | None = None
    # Which tool-server origins may receive each credential (origins.py); unset: loopback only.
    credential_origins_file: Path | None = None
    insecure_dev: bool = False
    max_ttl_seconds: float = DEFAULT_MAX_TTL_SECONDS
    health_interval_seconds: float = DEFAULT_HEALTH_INTERVAL_SECONDS
    log_level: str = "INFO"
    ready_file: Path | None = None
    store_environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.insecure_dev and self.auth_tokens_file is None:
            raise ConfigError(
                "no caller authentication: set ABADA_BROKER_AUTH_TOKENS_FILE (--auth-tokens-file), "
                "for instance to a file written by `abada-broker dev-tokens --out DIR`; or, on a machine "
                "nobody else can reach, run with --insecure-dev (ABADA_BROKER_INSECURE_DEV=1)"
            )
        if self.engine_token and self.engine_token_file is not None:
            raise ConfigError("set ABADA_ENGINE_TOKEN or ABADA_ENGINE_TOKEN_FILE, not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("ABADA_BROKER_TLS_CERT_FILE and ABADA_BROKER_TLS_KEY_FILE go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(
                "ABADA_BROKER_TLS_CLIENT_CA_FILE needs ABADA_BROKER_TLS_CERT_FILE and "
                "ABADA_BROKER_TLS_KEY_FILE: client certificates are only checked on a TLS listener"
            )
        if (self.engine_tls_cert_file is None) != (self.engine_tls_key_file is None):
            raise ConfigError("ABADA_ENGINE_TLS_CERT_FILE and ABADA_ENGINE_TLS_KEY_FILE go together")
        for name in ("max_ttl_seconds", "engine_timeout_seconds", "health_interval_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_VARIABLES[name]} must be a positive number of seconds")
        if self.log_level.upper() not in _LEVELS:
            raise ConfigError(
                f"ABADA_LOG_LEVEL must be one of {', '.join(sorted(_LEVELS))}, got {self.log_level!r}"
            )
        for name in ("grpc_address", "engine_address"):
            address: str = getattr(self, name)
            if not address or ":" not in address:
                raise ConfigError(f"{_VARIABLES[name]} must be HOST:PORT, got {address!r}")
        if self.insecure_dev:
            for name in ("grpc_address", "health_address"):
                address = getattr(self, name)
                if address is not None and not _is_loopback_address(address):
                    raise ConfigError(
                        f"--insecure-dev accepts every caller without a token, so it listens on loopback "
                        f"only: {_VARIABLES.get(name, 'ABADA_BROKER_HEALTH_ADDRESS')} is {address!r}"
                    )
        if self.health_address is not None and ":" not in self.health_address:
            raise ConfigError(f"ABADA_BROKER_HEALTH_ADDRESS must be HOST:PORT, got {self.health_address!r}")
        if self.metrics_address is not None and ":" not in self.metrics_address:
            raise ConfigError(f"ABADA_BROKER_METRICS_ADDRESS must be HOST:PORT, got {self.metrics_address!r}")

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
    def from_env(
        cls, environ: Mapping[str, str] | None = None, overrides: Mapping[str, object] | None = None
    ) -> BrokerSettings:
        """Settings from ``environ`` (default ``os.environ``); ``overrides`` (flags) win over it."""
        env = dict(os.environ if environ is None else environ)

        def text(variable: str) -> str | None:
            value = env.get(variable, "").strip()
            return value or None

        def path(variable: str) -> Path | None:
            value = text(variable)
            return None if value is None else Path(value)

        def seconds(variable: str, default: float) -> float:
            value = text(variable)
            if value is None:
                return default
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{variable} must be a number of seconds, got {value!r}") from None

        def flag(variable: str) -> bool:
            value = (text(variable) or "").lower()
            if value in _TRUE:
                return True
            if value in _FALSE:
                return False
            raise ConfigError(f"{variable} must be 1 or 0, got {value!r}")

        values: dict[str, object] = {
            "grpc_address": text("ABADA_BROKER_GRPC_ADDRESS") or DEFAULT_GRPC_ADDRESS,
            "tls_cert_file": path("ABADA_BROKER_TLS_CERT_FILE"),
            "tls_key_file": path("ABADA_BROKER_TLS_KEY_FILE"),
            "tls_client_ca_file": path("ABADA_BROKER_TLS_CLIENT_CA_FILE"),
            "health_address": text("ABADA_BROKER_HEALTH_ADDRESS"),
            "metrics_address": text("ABADA_BROKER_METRICS_ADDRESS"),
            "engine_address": text("ABADA_ENGINE_ADDRESS") or DEFAULT_ENGINE_ADDRESS,
            "engine_token": text("ABADA_ENGINE_TOKEN"),
            "engine_token_file": path("ABADA_ENGINE_TOKEN_FILE"),
            "engine_tls_ca_file": path("ABADA_ENGINE_TLS_CA_FILE"),
            "engine_tls_cert_file": path("ABADA_ENGINE_TLS_CERT_FILE"),
            "engine_tls_key_file": path("ABADA_ENGINE_TLS_KEY_FILE"),
            "engine_timeout_seconds": seconds("ABADA_ENGINE_TIMEOUT_SECONDS", DEFAULT_ENGINE_TIMEOUT_SECONDS),
            "auth_tokens_file": path("ABADA_BROKER_AUTH_TOKENS_FILE"),
            "credential_origins_file": path("ABADA_BROKER_CREDENTIAL_ORIGINS_FILE"),
            "insecure_dev": flag("ABADA_BROKER_INSECURE_DEV"),
            "max_ttl_seconds": seconds("ABADA_CREDENTIAL_MAX_TTL_SECONDS", DEFAULT_MAX_TTL_SECONDS),
            "health_interval_seconds": seconds(
                "ABADA_BROKER_HEALTH_INTERVAL_SECONDS", DEFAULT_HEALTH_INTERVAL_SECONDS
            ),
            "log_level": (text("ABADA_LOG_LEVEL") or "INFO").upper(),
            "ready_file": path("ABADA_BROKER_READY_FILE"),
        }
        store_overrides: dict[str, str] = {}
        for name, value in (overrides or {}).items():
            if value is None or value is False:
                continue
            if name == "secret_backend":
                store_overrides["ABADA_SECRET_BACKEND"] = str(value)
            elif name == "secrets_file":
                store_overrides["ABADA_SECRETS_FILE"] = str(value)
            elif name in values:
                values[name] = value
            else:
                raise ConfigError(f"unknown setting {name!r}")
        values["store_environ"] = {**env, **store_overrides}
        return cls(**values)  # type: ignore[arg-type]


_VARIABLES = {
    "grpc_address": "ABADA_BROKER_GRPC_ADDRESS",
    "engine_address": "ABADA_ENGINE_ADDRESS",
    "max_ttl_seconds": "ABADA_CREDENTIAL_MAX_TTL_SECONDS",
    "engine_timeout_seconds": "ABADA_ENGINE_TIMEOUT_SECONDS",
    "health_interval_seconds": "ABADA_BROKER_HEALTH_INTERVAL_SECONDS",
}


def _is_loopback_address(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
