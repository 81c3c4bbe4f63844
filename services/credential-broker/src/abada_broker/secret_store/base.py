"""What the rest of the broker sees of a secret store: :class:`SecretStore`, :class:`Secret` and the errors.

Errors are :class:`SecretNotFound`, :class:`SecretStoreUnavailable` (retryable: the store unreachable,
sealed, timing out or erring), :class:`SecretStoreAuthError` (the store refused the broker's identity or
its policy denies the read) and :class:`SecretStoreConfigError`, all :class:`SecretStoreError`. No message
and no log line of a store ever contains a secret value, a Vault token or a service-account JWT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

from abada_common.settings import SettingsError

DEFAULT_PATH_TEMPLATE = "abada/tool-credentials/{credential}"
CREDENTIAL_PLACEHOLDER = "{credential}"
# Credential names come from deployment bundles; keeping them to one path segment means a name can
# never reach outside the configured path template ("../", "/").
_CREDENTIAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, kw_only=True)
class Secret:
    """One version of one credential. ``repr`` and ``str`` never show the value."""

    name: str
    version: int
    value: str = field(repr=False)


class SecretStoreError(Exception):
    """Base of every secret-store failure. ``retryable`` tells the caller whether trying later may help."""

    retryable: ClassVar[bool] = False

    def __init__(self, message: str, *, credential: str | None = None) -> None:
        super().__init__(message)
        self.credential = credential


class SecretNotFound(SecretStoreError):
    """No live value for the credential: no such secret, its current version deleted, or no ``value``."""


class SecretStoreUnavailable(SecretStoreError):
    """The store cannot answer right now (unreachable, timing out, sealed, erring). Retry later."""

    retryable: ClassVar[bool] = True


class SecretStoreAuthError(SecretStoreError):
    """Vault refused the broker's identity, or its policy does not allow the read."""


class SecretStoreConfigError(SecretStoreError, SettingsError):
    """The store is configured wrongly (settings, environment, or the content of the secrets file); the
    message is one line naming the variable, as every other bad setting's."""


@runtime_checkable
class SecretStore(Protocol):
    async def read(self, credential: str) -> Secret:
        """The current value of ``credential``; raises a :class:`SecretStoreError`."""
        ...

    async def check(self) -> None:
        """Returns if the store can serve reads; raises a :class:`SecretStoreError` otherwise."""
        ...

    async def close(self) -> None: ...


def secret_path(path_template: str, credential: str) -> str:
    """The KV path of ``credential`` (mount excluded); refuses names that are not one safe segment."""
    if not isinstance(credential, str) or _CREDENTIAL_NAME.fullmatch(credential) is None:
        raise SecretNotFound(
            f"{credential!r} is not a valid credential name (letters, digits, '.', '_', '-'; at most 128)",
            credential=credential if isinstance(credential, str) else None,
        )
    return path_template.replace(CREDENTIAL_PLACEHOLDER, credential)
