"""Where the broker gets tool-server secrets: Vault KV v2 in production (:mod:`.vault`), a local file for
the offline demo (:mod:`.file`). The rest of the broker only sees :class:`SecretStore` (:mod:`.base`)::

    store = secret_store_from_env()          # ABADA_SECRET_BACKEND=vault|file
    secret = await store.read("crm-token")   # Secret(name, version, value); repr hides the value
    await store.check()                      # readiness: Vault reachable, unsealed, our token valid
    await store.close()
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from abada_common.settings import ServiceSettings, SettingsError, variable
from pydantic import BeforeValidator, model_validator

from .base import (
    DEFAULT_PATH_TEMPLATE,
    Secret,
    SecretNotFound,
    SecretStore,
    SecretStoreAuthError,
    SecretStoreConfigError,
    SecretStoreError,
    SecretStoreUnavailable,
    secret_path,
)
from .file import FileSecretStore
from .vault import DEFAULT_KUBERNETES_JWT_FILE, VaultSecretStore, VaultSettings


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


class SecretBackendSettings(ServiceSettings):
    """Which store the broker reads; the Vault store has its own settings (:class:`VaultSettings`)."""

    backend: Annotated[Literal["vault", "file"], BeforeValidator(_lower)] = variable(
        "ABADA_SECRET_BACKEND", "vault", "where tool secrets are read", accepts="'vault' or 'file'"
    )
    secrets_file: Path | None = variable(
        "ABADA_SECRETS_FILE", None, "the YAML file of name: value pairs (backend file; the offline demo)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.backend == "file" and self.secrets_file is None:
            raise ValueError("ABADA_SECRET_BACKEND=file needs ABADA_SECRETS_FILE")
        return self


def secret_store_from_env(environ: Mapping[str, str] | None = None) -> SecretStore:
    """The store ``ABADA_SECRET_BACKEND`` names, configured from ``environ`` (default: the process's)."""
    try:
        chosen = SecretBackendSettings.from_env(environ)
    except SettingsError as error:
        raise SecretStoreConfigError(str(error)) from None
    if chosen.backend == "file":
        assert chosen.secrets_file is not None  # checked by _consistent
        return FileSecretStore(chosen.secrets_file)
    return VaultSecretStore(VaultSettings.from_env(environ))


__all__ = [
    "DEFAULT_KUBERNETES_JWT_FILE",
    "DEFAULT_PATH_TEMPLATE",
    "FileSecretStore",
    "Secret",
    "SecretBackendSettings",
    "SecretNotFound",
    "SecretStore",
    "SecretStoreAuthError",
    "SecretStoreConfigError",
    "SecretStoreError",
    "SecretStoreUnavailable",
    "VaultSecretStore",
    "VaultSettings",
    "secret_path",
    "secret_store_from_env",
]
