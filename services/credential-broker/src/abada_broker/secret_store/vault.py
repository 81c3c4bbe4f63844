"""The broker's production secret store: Vault (or OpenBao) KV v2, read with the broker's own identity.

Rotation: ``vault kv put secret/abada/tool-credentials/crm-token value=...`` reaches the very next
``read``. Each read asks Vault for the secret's ``current_version`` (KV v2 metadata) and serves the value
cached for that exact (credential, version) if it is younger than ``cache_seconds``; otherwise it reads
that version. The broker's Vault policy therefore needs ``read`` on both paths::

    path "secret/data/abada/tool-credentials/*"     { capabilities = ["read"] }
    path "secret/metadata/abada/tool-credentials/*" { capabilities = ["read"] }

With ``cache_seconds=0`` every read is a single read of the latest version and the metadata rule is not
needed. The broker's token is kept alive by :mod:`.vault_auth`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Self

import hvac
import hvac.exceptions
import requests
from abada_common.settings import ServiceSettings, SettingsError, variable
from pydantic import BeforeValidator, model_validator

from .base import (
    CREDENTIAL_PLACEHOLDER,
    DEFAULT_PATH_TEMPLATE,
    Secret,
    SecretNotFound,
    SecretStoreAuthError,
    SecretStoreConfigError,
    SecretStoreError,
    SecretStoreUnavailable,
    secret_path,
)
from .vault_auth import (
    AuthMethod,
    KubernetesAuth,
    StaticTokenAuth,
    VaultLoginError,
    VaultTokenKeeper,
    http_status_of,
    vault_error_summary,
)

logger = logging.getLogger("abada_broker.secret_store.vault")

DEFAULT_KUBERNETES_JWT_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
# The upkeep task is woken when a new token arrives; this only bounds its sleep as a safety net.
_UPKEEP_MAX_SLEEP_SECONDS = 5.0
_UPKEEP_MAX_BACKOFF_SECONDS = 30.0
# Vault answers these when it exists but cannot serve right now (sealed, standby trouble, overload).
_VAULT_UNAVAILABLE_ERRORS = (
    hvac.exceptions.InternalServerError,
    hvac.exceptions.BadGateway,
    hvac.exceptions.VaultDown,
    hvac.exceptions.VaultNotInitialized,
    hvac.exceptions.RateLimitExceeded,
    hvac.exceptions.UnexpectedError,
)
# sys/health codes of a node that serves requests: active, standby, DR secondary, performance standby.
_HEALTHY_STATUSES = frozenset({200, 429, 472, 473})


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _seconds(name: str, default: float, description: str, *, positive: bool = False) -> Any:
    bound: dict[str, Any] = {"gt": 0} if positive else {"ge": 0}
    return variable(name, default, description, accepts="a number of seconds", allow_inf_nan=False, **bound)


class VaultSettings(ServiceSettings):
    """Where and how the broker reads Vault; every field is an environment variable (``abada-broker serve
    --help`` lists them)."""

    address: str = variable("VAULT_ADDR", "http://127.0.0.1:8200", "Vault's address (http:// or https://)")
    kv_mount: str = variable("ABADA_VAULT_KV_MOUNT", "secret", "the KV v2 engine's mount")
    path_template: str = variable(
        "ABADA_VAULT_PATH_TEMPLATE",
        DEFAULT_PATH_TEMPLATE,
        "a credential's path under the mount; {credential} is its name",
    )
    value_field: str = variable("ABADA_VAULT_VALUE_FIELD", "value", "the secret's field holding the value")
    auth_method: Annotated[Literal["token", "kubernetes"], BeforeValidator(_lower)] = variable(
        "ABADA_VAULT_AUTH", "token", "how the broker logs in to Vault", accepts="'token' or 'kubernetes'"
    )
    token: str | None = variable(
        "VAULT_TOKEN", None, "the broker's Vault token (auth token)", accepts="text", repr=False
    )
    token_file: Path | None = variable(
        "ABADA_VAULT_TOKEN_FILE", None, "or a file holding it, read again when Vault rejects the token"
    )
    kubernetes_role: str | None = variable("ABADA_VAULT_K8S_ROLE", None, "the Vault role (auth kubernetes)")
    kubernetes_jwt_file: Path = variable(
        "ABADA_VAULT_K8S_JWT_FILE", DEFAULT_KUBERNETES_JWT_FILE, "the pod's service-account token"
    )
    kubernetes_mount: str = variable("ABADA_VAULT_K8S_MOUNT", "kubernetes", "the Kubernetes auth mount")
    renew_before_seconds: float = _seconds(
        "ABADA_VAULT_RENEW_BEFORE_SECONDS",
        300.0,
        "renew the token when this much of its lease is left",
        positive=True,
    )
    cache_seconds: float = _seconds(
        "ABADA_SECRET_CACHE_SECONDS", 5.0, "how long a value read for one credential version is served again"
    )
    version_check_seconds: float = _seconds(
        "ABADA_SECRET_VERSION_CHECK_SECONDS",
        0.0,
        "how long a credential's current version is trusted before asking Vault again (0: every read)",
    )
    # Both caching windows are bounded so a rotation or deletion is never hidden for long; raise this
    # explicitly to allow longer ones.
    max_cache_seconds: float = _seconds(
        "ABADA_SECRET_MAX_CACHE_SECONDS", 30.0, "the longest either caching window may be"
    )
    request_timeout_seconds: float = _seconds(
        "ABADA_VAULT_TIMEOUT_SECONDS", 5.0, "how long one request to Vault may take", positive=True
    )
    ca_cert: Path | None = variable("VAULT_CACERT", None, "the CA that signed Vault's certificate")
    client_cert: Path | None = variable("VAULT_CLIENT_CERT", None, "a client certificate for Vault (mTLS)")
    client_key: Path | None = variable("VAULT_CLIENT_KEY", None, "its private key")
    skip_verify: bool = variable("VAULT_SKIP_VERIFY", False, "1 does not check Vault's certificate")
    namespace: str | None = variable("VAULT_NAMESPACE", None, "the Vault Enterprise namespace")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        try:
            return super().from_env(environ, **overrides)
        except SettingsError as error:
            raise SecretStoreConfigError(f"invalid Vault settings: {error}") from None

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not self.address.startswith(("http://", "https://")):
            raise ValueError(f"VAULT_ADDR must start with http:// or https:// (got {self.address!r})")
        if not self.kv_mount.strip("/"):
            raise ValueError("ABADA_VAULT_KV_MOUNT must not be empty")
        if self.path_template.count(CREDENTIAL_PLACEHOLDER) != 1:
            raise ValueError(
                f"ABADA_VAULT_PATH_TEMPLATE must contain {CREDENTIAL_PLACEHOLDER} exactly once "
                f"(got {self.path_template!r})"
            )
        if self.path_template.startswith("/"):
            raise ValueError(
                "ABADA_VAULT_PATH_TEMPLATE is relative to the KV mount and must not start with '/'"
            )
        if self.auth_method == "token" and not self.token and self.token_file is None:
            raise ValueError(
                "token auth needs a token (VAULT_TOKEN) or a token file (ABADA_VAULT_TOKEN_FILE)"
            )
        if self.auth_method == "kubernetes" and not self.kubernetes_role:
            raise ValueError("kubernetes auth needs a role (ABADA_VAULT_K8S_ROLE)")
        for name, seconds in (
            ("ABADA_SECRET_CACHE_SECONDS", self.cache_seconds),
            ("ABADA_SECRET_VERSION_CHECK_SECONDS", self.version_check_seconds),
        ):
            if seconds > self.max_cache_seconds:
                raise ValueError(
                    f"{name} must be between 0 and ABADA_SECRET_MAX_CACHE_SECONDS "
                    f"({self.max_cache_seconds:g}), got {seconds:g}"
                )
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("VAULT_CLIENT_KEY needs VAULT_CLIENT_CERT")
        return self

    @property
    def tls_verify(self) -> bool:
        return not self.skip_verify

    def auth(self) -> AuthMethod:
        if self.auth_method == "kubernetes":
            assert self.kubernetes_role is not None  # checked by _consistent
            return KubernetesAuth(
                role=self.kubernetes_role,
                jwt_file=self.kubernetes_jwt_file,
                mount=self.kubernetes_mount.strip("/"),
            )
        return StaticTokenAuth(token=self.token, token_file=self.token_file)


@dataclass(frozen=True)
class _CachedValue:
    secret: Secret
    stored_at: float


class VaultSecretStore:
    """Reads ``{kv_mount}/data/{path_template}`` with the broker's own Vault identity."""

    def __init__(self, settings: VaultSettings) -> None:
        self._settings = settings
        self._mount = settings.kv_mount.strip("/")
        verify: bool | str = str(settings.ca_cert) if settings.ca_cert is not None else settings.tls_verify
        if not settings.tls_verify:
            verify = False
        cert = None
        if settings.client_cert is not None:
            cert = (str(settings.client_cert), str(settings.client_key or settings.client_cert))
        # token="" and explicit TLS settings: hvac must not pick up VAULT_TOKEN, ~/.vault-token or
        # VAULT_CACERT behind the settings' back.
        self._client = hvac.Client(
            url=settings.address,
            token="",
            verify=verify,
            cert=cert,
            # types-hvac says int; hvac hands the timeout to requests, which takes seconds as a float.
            timeout=settings.request_timeout_seconds,  # type: ignore[arg-type]
            namespace=settings.namespace,
        )
        self._keeper = VaultTokenKeeper(
            self._client,
            settings.auth(),
            renew_before_seconds=settings.renew_before_seconds,
            on_new_token=self._token_schedule_changed,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._schedule_changed = asyncio.Event()
        # Besides the per-request timeout, one read (login, metadata, data, one re-login) is bounded.
        self._deadline_seconds = settings.request_timeout_seconds * 4
        self._values: dict[tuple[str, int], _CachedValue] = {}
        self._versions: dict[str, tuple[int, float]] = {}
        self._upkeep: asyncio.Task[None] | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"VaultSecretStore(address={self._settings.address!r}, auth={self._keeper.auth_method_name!r})"

    async def read(self, credential: str) -> Secret:
        path = secret_path(self._settings.path_template, credential)
        self._ensure_open()
        self._start_token_upkeep()
        try:
            async with asyncio.timeout(self._deadline_seconds):
                return await self._read(credential, path)
        except TimeoutError:
            raise SecretStoreUnavailable(
                f"Vault at {self._settings.address} did not answer within {self._deadline_seconds:g} s "
                f"reading credential {credential!r}",
                credential=credential,
            ) from None

    async def check(self) -> None:
        self._ensure_open()
        self._start_token_upkeep()
        try:
            async with asyncio.timeout(self._deadline_seconds):
                await asyncio.to_thread(self._check_blocking)
        except TimeoutError:
            raise SecretStoreUnavailable(
                f"Vault at {self._settings.address} did not answer within {self._deadline_seconds:g} s"
            ) from None

    async def close(self) -> None:
        self._closed = True
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._upkeep
            self._upkeep = None
        self._values.clear()
        self._versions.clear()
        self._keeper.forget()
        await asyncio.to_thread(self._client.adapter.close)

    # ---- reading ---------------------------------------------------------------------------------

    async def _read(self, credential: str, path: str) -> Secret:
        settings = self._settings
        loop = asyncio.get_running_loop()
        if settings.cache_seconds == 0:
            secret = await asyncio.to_thread(self._read_version_blocking, credential, path, None)
            logger.debug(
                "read credential from Vault", extra={"credential": credential, "version": secret.version}
            )
            return secret

        now = loop.time()
        known = self._versions.get(credential)
        if known is not None and now - known[1] < settings.version_check_seconds:
            version, cacheable = known[0], True
        else:
            version, cacheable = await asyncio.to_thread(self._current_version_blocking, credential, path)
            if cacheable:
                self._versions[credential] = (version, loop.time())
            else:
                self._versions.pop(credential, None)

        cached = self._values.get((credential, version)) if cacheable else None
        if cached is not None and loop.time() - cached.stored_at < settings.cache_seconds:
            logger.debug("served credential from cache", extra={"credential": credential, "version": version})
            return cached.secret

        secret = await asyncio.to_thread(self._read_version_blocking, credential, path, version)
        if cacheable:
            self._remember(secret, loop.time())
        logger.debug(
            "read credential from Vault", extra={"credential": credential, "version": secret.version}
        )
        return secret

    def _remember(self, secret: Secret, now: float) -> None:
        stale = [
            key
            for key, entry in self._values.items()
            if key[0] == secret.name or now - entry.stored_at >= self._settings.cache_seconds
        ]
        for key in stale:
            del self._values[key]
        self._values[(secret.name, secret.version)] = _CachedValue(secret, now)

    def _current_version_blocking(self, credential: str, path: str) -> tuple[int, bool]:
        """(current version, whether it may be served from cache). Runs in a worker thread."""
        where = f"{self._mount}/metadata/{path}"
        with self._translated_errors(credential, f"reading {where}"):
            response = self._keeper.call(
                lambda client: client.secrets.kv.v2.read_secret_metadata(path=path, mount_point=self._mount)
            )
        try:
            metadata = response["data"]
            version = int(metadata["current_version"])
            versions = metadata.get("versions") or {}
            state = versions.get(str(version)) if isinstance(versions, dict) else None
        except (KeyError, TypeError, ValueError):
            raise SecretStoreError(
                f"unexpected answer from Vault for {where}", credential=credential
            ) from None
        if version <= 0 or (isinstance(state, dict) and state.get("destroyed")):
            raise SecretNotFound(
                f"credential {credential!r} has no live version at {self._mount}/{path}",
                credential=credential,
            )
        # A version with a deletion time is deleted or scheduled for deletion: let Vault decide on every
        # read instead of trusting a cache.
        deletion_pending = isinstance(state, dict) and bool(state.get("deletion_time"))
        return version, not deletion_pending

    def _read_version_blocking(self, credential: str, path: str, version: int | None) -> Secret:
        where = f"{self._mount}/data/{path}" + ("" if version is None else f"?version={version}")
        with self._translated_errors(credential, f"reading {where}"):
            response = self._keeper.call(
                lambda client: client.secrets.kv.v2.read_secret_version(
                    path=path, version=version, mount_point=self._mount, raise_on_deleted_version=True
                )
            )
        try:
            data = response["data"]["data"]
            number = int(response["data"]["metadata"]["version"])
        except (KeyError, TypeError, ValueError):
            raise SecretStoreError(
                f"unexpected answer from Vault for {where}", credential=credential
            ) from None
        field_name = self._settings.value_field
        value = data.get(field_name) if isinstance(data, dict) else None
        if not isinstance(value, str) or not value:
            raise SecretNotFound(
                f"credential {credential!r} at {self._mount}/{path} (version {number}) has no non-empty string "
                f"field {field_name!r}",
                credential=credential,
            )
        return Secret(name=credential, version=number, value=value)

    def _check_blocking(self) -> None:
        with self._translated_errors(None, "checking Vault's health"):
            health = self._client.sys.read_health_status(method="GET")
            status = health.status_code if isinstance(health, requests.Response) else 200
            if status not in _HEALTHY_STATUSES:
                sealed = status == 503
                raise SecretStoreUnavailable(
                    f"Vault at {self._settings.address} is not serving (sys/health answered HTTP {status}"
                    + (", sealed)" if sealed else ")")
                )
            self._keeper.call(lambda client: client.auth.token.lookup_self())

    @contextlib.contextmanager
    def _translated_errors(self, credential: str | None, action: str) -> Iterator[None]:
        """Map hvac/requests failures to the store's errors, with messages built only from Vault's error
        texts and our own words, and without chaining the original (which holds response bodies)."""
        address = self._settings.address
        subject = "" if credential is None else f" (credential {credential!r})"
        try:
            yield
        except SecretStoreError:
            raise
        except VaultLoginError as error:
            raise SecretStoreAuthError(f"{error}{subject}", credential=credential) from None
        except hvac.exceptions.InvalidPath:
            raise SecretNotFound(f"no secret found {action}{subject}", credential=credential) from None
        except hvac.exceptions.Forbidden as error:
            raise SecretStoreAuthError(
                f"Vault denied {action}{subject}: {vault_error_summary(error)}. The broker's Vault policy must "
                f"allow 'read' on {self._mount}/data/{self._policy_glob()} and {self._mount}/metadata/"
                f"{self._policy_glob()}",
                credential=credential,
            ) from None
        except _VAULT_UNAVAILABLE_ERRORS as error:
            raise SecretStoreUnavailable(
                f"Vault at {address} could not serve {action}{subject} (HTTP {http_status_of(error)}): "
                f"{vault_error_summary(error)}",
                credential=credential,
            ) from None
        except hvac.exceptions.VaultError as error:
            raise SecretStoreError(
                f"Vault refused {action}{subject} (HTTP {http_status_of(error)}): {vault_error_summary(error)}",
                credential=credential,
            ) from None
        except requests.exceptions.RequestException as error:
            kind = (
                "TLS handshake failed"
                if isinstance(error, requests.exceptions.SSLError)
                else "cannot reach Vault"
            )
            raise SecretStoreUnavailable(
                f"{kind} at {address} {action}{subject}: {type(error).__name__}", credential=credential
            ) from None

    def _policy_glob(self) -> str:
        return self._settings.path_template.replace(CREDENTIAL_PLACEHOLDER, "*")

    # ---- token upkeep ----------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise SecretStoreError("the Vault secret store is closed")

    def _start_token_upkeep(self) -> None:
        if self._upkeep is None or self._upkeep.done():
            self._loop = asyncio.get_running_loop()
            self._upkeep = self._loop.create_task(self._keep_token_fresh(), name="vault-token-upkeep")

    def _token_schedule_changed(self) -> None:
        """Called from a worker thread when a new token is installed: wake the upkeep task."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._schedule_changed.set)

    async def _sleep_unless_rescheduled(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._schedule_changed.wait(), timeout=seconds)

    async def _keep_token_fresh(self) -> None:
        """Renews (or, with kubernetes auth, replaces) the token ahead of expiry even when no read comes."""
        failures = 0
        while True:
            self._schedule_changed.clear()
            due_in = self._keeper.seconds_until_due()
            if due_in is None or due_in > 0:
                limit = _UPKEEP_MAX_SLEEP_SECONDS
                await self._sleep_unless_rescheduled(
                    limit if due_in is None else max(0.01, min(due_in, limit))
                )
                continue
            try:
                await asyncio.to_thread(self._ensure_token_blocking)
                failures = 0
                await asyncio.sleep(0.01)  # never spin, whatever the schedule says
            except SecretStoreError as error:
                failures += 1
                logger.warning("Vault token upkeep failed: %s", error, extra={"attempt": failures})
                await asyncio.sleep(min(_UPKEEP_MAX_BACKOFF_SECONDS, 0.5 * 2 ** min(failures, 6)))
            except Exception as error:  # keep the task alive; the type is enough to investigate
                failures += 1
                logger.error("unexpected %s in Vault token upkeep", type(error).__name__)
                await asyncio.sleep(_UPKEEP_MAX_BACKOFF_SECONDS)

    def _ensure_token_blocking(self) -> None:
        with self._translated_errors(None, "renewing the broker's Vault token"):
            self._keeper.ensure_token()
