"""Where the broker gets tool-server secrets: Vault KV v2 in production, a local file for the offline demo.

The rest of the broker only sees :class:`SecretStore`::

    store = secret_store_from_env()          # ABADA_SECRET_BACKEND=vault|file
    secret = await store.read("crm-token")   # Secret(name, version, value); repr hides the value
    await store.check()                      # readiness: Vault reachable, unsealed, our token valid
    await store.close()

Errors are :class:`SecretNotFound`, :class:`SecretStoreUnavailable` (retryable: Vault unreachable,
sealed, timing out or erring), :class:`SecretStoreAuthError` (Vault refused the broker's identity or its
policy denies the read) and :class:`SecretStoreConfigError`, all :class:`SecretStoreError`. No message and
no log line of this module ever contains a secret value, a Vault token or a service-account JWT.

Rotation: ``vault kv put secret/abada/tool-credentials/crm-token value=...`` reaches the very next
``read``. Each read asks Vault for the secret's ``current_version`` (KV v2 metadata) and serves the value
cached for that exact (credential, version) if it is younger than ``cache_seconds``; otherwise it reads
that version. The broker's Vault policy therefore needs ``read`` on both paths::

    path "secret/data/abada/tool-credentials/*"     { capabilities = ["read"] }
    path "secret/metadata/abada/tool-credentials/*" { capabilities = ["read"] }

With ``cache_seconds=0`` every read is a single read of the latest version and the metadata rule is not
needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import hvac
import hvac.exceptions
import requests
import yaml

from abada_broker.vault_auth import (
    AuthMethod,
    KubernetesAuth,
    StaticTokenAuth,
    VaultLoginError,
    VaultTokenKeeper,
    http_status_of,
    vault_error_summary,
)

logger = logging.getLogger("abada_broker.secret_store")

DEFAULT_KUBERNETES_JWT_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
DEFAULT_PATH_TEMPLATE = "abada/tool-credentials/{credential}"
CREDENTIAL_PLACEHOLDER = "{credential}"
# Credential names come from deployment bundles; keeping them to one path segment means a name can
# never reach outside the configured path template ("../", "/").
_CREDENTIAL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
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


# ---- the interface ---------------------------------------------------------------------------------


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


class SecretStoreConfigError(SecretStoreError):
    """The store is configured wrongly (settings, environment, or the content of the secrets file)."""


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


# ---- Vault -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class VaultSettings:
    address: str = "http://127.0.0.1:8200"
    kv_mount: str = "secret"
    path_template: str = DEFAULT_PATH_TEMPLATE
    value_field: str = "value"
    auth_method: Literal["token", "kubernetes"] = "token"
    token: str | None = field(default=None, repr=False)
    token_file: Path | None = None
    kubernetes_role: str | None = None
    kubernetes_jwt_file: Path = DEFAULT_KUBERNETES_JWT_FILE
    kubernetes_mount: str = "kubernetes"
    # Renew when this much of the token's lease is left (at most half the lease, for short leases).
    renew_before_seconds: float = 300.0
    # How long a value read for one (credential, version) may be served again.
    cache_seconds: float = 5.0
    # How long a seen current_version is trusted before asking Vault again; 0: on every read, so a new
    # version reaches the very next read.
    version_check_seconds: float = 0.0
    # Both caching windows are bounded so a rotation or deletion is never hidden for long; raise this
    # explicitly to allow longer ones.
    max_cache_seconds: float = 30.0
    request_timeout_seconds: float = 5.0
    ca_cert: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    tls_verify: bool = True
    namespace: str | None = None

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise SecretStoreConfigError("invalid Vault settings: " + "; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if not self.address.startswith(("http://", "https://")):
            yield f"address must start with http:// or https:// (got {self.address!r})"
        if not self.kv_mount.strip("/"):
            yield "kv_mount must not be empty"
        if self.path_template.count(CREDENTIAL_PLACEHOLDER) != 1:
            yield f"path_template must contain {CREDENTIAL_PLACEHOLDER} exactly once (got {self.path_template!r})"
        if self.path_template.startswith("/"):
            yield "path_template is relative to the KV mount and must not start with '/'"
        if not self.value_field:
            yield "value_field must not be empty"
        if self.auth_method not in ("token", "kubernetes"):
            yield f"auth_method must be 'token' or 'kubernetes' (got {self.auth_method!r})"
        if self.auth_method == "token" and not self.token and self.token_file is None:
            yield "token auth needs a token (VAULT_TOKEN) or a token file (ABADA_VAULT_TOKEN_FILE)"
        if self.auth_method == "kubernetes" and not self.kubernetes_role:
            yield "kubernetes auth needs a role (ABADA_VAULT_K8S_ROLE)"
        if self.renew_before_seconds <= 0:
            yield "renew_before_seconds must be positive"
        for name in ("cache_seconds", "version_check_seconds"):
            seconds = getattr(self, name)
            if not 0 <= seconds <= self.max_cache_seconds:
                yield f"{name} must be between 0 and max_cache_seconds ({self.max_cache_seconds:g}), got {seconds:g}"
        if self.request_timeout_seconds <= 0:
            yield "request_timeout_seconds must be positive"
        if self.client_key is not None and self.client_cert is None:
            yield "client_key needs client_cert"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> VaultSettings:
        """Settings from the environment (``os.environ`` unless given). Unset variables keep the defaults.

        VAULT_ADDR, VAULT_TOKEN, VAULT_CACERT, VAULT_CLIENT_CERT, VAULT_CLIENT_KEY, VAULT_SKIP_VERIFY,
        VAULT_NAMESPACE, ABADA_VAULT_AUTH (token|kubernetes), ABADA_VAULT_TOKEN_FILE, ABADA_VAULT_K8S_ROLE,
        ABADA_VAULT_K8S_JWT_FILE, ABADA_VAULT_K8S_MOUNT, ABADA_VAULT_KV_MOUNT, ABADA_VAULT_PATH_TEMPLATE,
        ABADA_VAULT_VALUE_FIELD, ABADA_VAULT_RENEW_BEFORE_SECONDS, ABADA_VAULT_TIMEOUT_SECONDS,
        ABADA_SECRET_CACHE_SECONDS, ABADA_SECRET_VERSION_CHECK_SECONDS, ABADA_SECRET_MAX_CACHE_SECONDS.
        """
        env = os.environ if environ is None else environ

        def text(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def path(name: str) -> Path | None:
            value = text(name)
            return None if value is None else Path(value)

        def seconds(name: str) -> float | None:
            value = text(name)
            if value is None:
                return None
            try:
                return float(value)
            except ValueError:
                raise SecretStoreConfigError(f"{name} must be a number of seconds, got {value!r}") from None

        auth = (text("ABADA_VAULT_AUTH") or "token").lower()
        if auth not in ("token", "kubernetes"):
            raise SecretStoreConfigError(f"ABADA_VAULT_AUTH must be 'token' or 'kubernetes', got {auth!r}")
        skip_verify = (text("VAULT_SKIP_VERIFY") or "").lower() in ("1", "true", "yes")
        given: dict[str, Any] = {
            "address": text("VAULT_ADDR"),
            "token": text("VAULT_TOKEN"),
            "token_file": path("ABADA_VAULT_TOKEN_FILE"),
            "auth_method": auth,
            "kubernetes_role": text("ABADA_VAULT_K8S_ROLE"),
            "kubernetes_jwt_file": path("ABADA_VAULT_K8S_JWT_FILE"),
            "kubernetes_mount": text("ABADA_VAULT_K8S_MOUNT"),
            "kv_mount": text("ABADA_VAULT_KV_MOUNT"),
            "path_template": text("ABADA_VAULT_PATH_TEMPLATE"),
            "value_field": text("ABADA_VAULT_VALUE_FIELD"),
            "renew_before_seconds": seconds("ABADA_VAULT_RENEW_BEFORE_SECONDS"),
            "request_timeout_seconds": seconds("ABADA_VAULT_TIMEOUT_SECONDS"),
            "cache_seconds": seconds("ABADA_SECRET_CACHE_SECONDS"),
            "version_check_seconds": seconds("ABADA_SECRET_VERSION_CHECK_SECONDS"),
            "max_cache_seconds": seconds("ABADA_SECRET_MAX_CACHE_SECONDS"),
            "ca_cert": path("VAULT_CACERT"),
            "client_cert": path("VAULT_CLIENT_CERT"),
            "client_key": path("VAULT_CLIENT_KEY"),
            "tls_verify": not skip_verify,
            "namespace": text("VAULT_NAMESPACE"),
        }
        return cls(**{name: value for name, value in given.items() if value is not None})

    def auth(self) -> AuthMethod:
        if self.auth_method == "kubernetes":
            assert self.kubernetes_role is not None  # checked in __post_init__
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

    @property
    def settings(self) -> VaultSettings:
        return self._settings

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


# ---- the offline file ------------------------------------------------------------------------------


class FileSecretStore:
    """Secrets from a YAML (or JSON) file: ``name: value`` or ``name: {value: ..., version: N}``.

    The file is read on every ``read``, so rewriting it rotates a secret at once; write it atomically
    (write a temporary file, then rename) so a reader never sees half a file. A plain value gets
    version 1, and the next version each time its value changes while the store runs.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._fingerprint: bytes | None = None
        self._secrets: dict[str, Secret] = {}

    @property
    def path(self) -> Path:
        return self._path

    def __repr__(self) -> str:
        return f"FileSecretStore({str(self._path)!r})"

    async def read(self, credential: str) -> Secret:
        secrets_by_name = await asyncio.to_thread(self._load)
        secret = secrets_by_name.get(credential)
        if secret is None:
            raise SecretNotFound(
                f"credential {credential!r} is not in the secrets file {str(self._path)!r}",
                credential=credential,
            )
        return secret

    async def check(self) -> None:
        await asyncio.to_thread(self._load)

    async def close(self) -> None:
        return None

    def _load(self) -> dict[str, Secret]:
        try:
            raw = self._path.read_bytes()
        except OSError as error:
            raise SecretStoreUnavailable(
                f"cannot read the secrets file {str(self._path)!r}: {error.strerror or type(error).__name__}"
            ) from None
        fingerprint = hashlib.sha256(raw).digest()
        with self._lock:
            if fingerprint != self._fingerprint:
                self._secrets = self._parse(raw, previous=self._secrets)
                self._fingerprint = fingerprint
            return self._secrets

    def _parse(self, raw: bytes, *, previous: Mapping[str, Secret]) -> dict[str, Secret]:
        where = repr(str(self._path))
        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            # PyYAML's own message quotes the offending line, which may hold a secret: give the position only.
            mark = getattr(error, "problem_mark", None)
            position = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
            raise SecretStoreConfigError(
                f"the secrets file {where} is not valid YAML or JSON{position}"
            ) from None
        if document is None:
            return {}
        if not isinstance(document, dict):
            raise SecretStoreConfigError(f"the secrets file {where} must map credential names to values")
        loaded: dict[str, Secret] = {}
        for name, entry in document.items():
            if not isinstance(name, str):
                raise SecretStoreConfigError(f"the secrets file {where} has a non-text credential name")
            value, version = self._entry(name, entry, where)
            if version is None:
                before = previous.get(name)
                if before is None:
                    version = 1
                elif before.value == value:
                    version = before.version
                else:
                    version = before.version + 1
            loaded[name] = Secret(name=name, version=version, value=value)
        return loaded

    @staticmethod
    def _entry(name: str, entry: object, where: str) -> tuple[str, int | None]:
        shape = "a non-empty string or {value: <string>, version: <positive integer>}"
        if isinstance(entry, str) and entry:
            return entry, None
        if isinstance(entry, dict):
            value, version = entry.get("value"), entry.get("version")
            extra = set(entry) - {"value", "version"}
            version_ok = version is None or (
                isinstance(version, int) and not isinstance(version, bool) and version > 0
            )
            if isinstance(value, str) and value and version_ok and not extra:
                return value, version
        raise SecretStoreConfigError(
            f"credential {name!r} in the secrets file {where} must be {shape}", credential=name
        )


# ---- choosing one ----------------------------------------------------------------------------------


def secret_store_from_env(environ: Mapping[str, str] | None = None) -> SecretStore:
    """``ABADA_SECRET_BACKEND=vault`` (default; see :meth:`VaultSettings.from_env`) or ``file`` with
    ``ABADA_SECRETS_FILE``."""
    env = os.environ if environ is None else environ
    backend = (env.get("ABADA_SECRET_BACKEND") or "vault").strip().lower()
    if backend == "vault":
        return VaultSecretStore(VaultSettings.from_env(env))
    if backend == "file":
        path = (env.get("ABADA_SECRETS_FILE") or "").strip()
        if not path:
            raise SecretStoreConfigError("ABADA_SECRET_BACKEND=file needs ABADA_SECRETS_FILE")
        return FileSecretStore(path)
    raise SecretStoreConfigError(f"ABADA_SECRET_BACKEND must be 'vault' or 'file', got {backend!r}")


__all__ = [
    "DEFAULT_KUBERNETES_JWT_FILE",
    "DEFAULT_PATH_TEMPLATE",
    "FileSecretStore",
    "Secret",
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
