"""An in-test Vault: a real HTTP server on 127.0.0.1 that speaks the parts of Vault's API the broker uses.

The request and response shapes, status codes and error texts follow Vault 1.15-1.17 (the HTTP API
documented at developer.hashicorp.com/vault/api-docs): the response envelope (``request_id``,
``lease_id``, ``renewable``, ``lease_duration``, ``data``, ``wrap_info``, ``warnings``, ``auth``,
``mount_type``), ``{"errors": [...]}`` bodies, 403 for a missing, expired or unknown token, 404 for an
unknown path or a deleted/destroyed version, 400 for bad input, 405 for an unsupported operation and
503 while sealed.

Served endpoints:

- KV v2 at every enabled mount (``secret`` by default): ``data/{path}`` GET (``?version=``),
  POST/PUT (``options.cas``), DELETE; ``metadata/{path}`` GET, LIST (or ``?list=true``), POST, DELETE;
  ``delete/``, ``undelete/``, ``destroy/`` POST/PUT; ``config`` GET/POST.
- Token auth: ``auth/token/lookup-self`` GET/POST, ``auth/token/renew-self`` POST/PUT,
  ``auth/token/revoke-self`` POST/PUT.
- Kubernetes auth at every enabled mount (``kubernetes`` by default): ``auth/{mount}/login`` POST.
- ``sys/health`` GET/HEAD.

Deliberate simplifications: no namespaces, no response wrapping, no entities; ACLs are a union of the
capabilities of every rule whose path pattern matches (a ``deny`` anywhere wins), not Vault's
most-specific-rule priority; tokens expire on the wall clock and vanish on expiry.

Use it from a test::

    with FakeVault() as vault:
        vault.put_secret("abada/tool-credentials/crm-token", {"value": "s3cret"})
        token = vault.create_token(ttl=60, policies=["reader"])
        client = hvac.Client(url=vault.url, token=token)
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import fnmatch
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

VAULT_VERSION = "1.17.6"
# Vault's system default and maximum lease TTL (768h) when a mount or role sets none.
SYSTEM_MAX_TTL_SECONDS = 768 * 3600
KV_DEFAULT_MAX_VERSIONS = 10

ROOT_POLICY = "root"
DEFAULT_POLICY = "default"

# The subset of Vault's built-in "default" policy that matters here: every token may look itself up,
# renew and revoke itself.
_DEFAULT_POLICY_RULES: dict[str, tuple[str, ...]] = {
    "auth/token/lookup-self": ("read",),
    "auth/token/renew-self": ("update",),
    "auth/token/revoke-self": ("update",),
}

# Vault answers these exact bodies; clients (and our broker) may look at them.
_ERR_NO_TOKEN = "permission denied"
_ERR_BAD_TOKEN = "2 errors occurred:\n\t* permission denied\n\t* invalid token\n\n"
_ERR_POLICY_DENIED = "1 error occurred:\n\t* permission denied\n\n"
_ERR_UNSUPPORTED = "1 error occurred:\n\t* unsupported operation\n\n"

JsonObject = dict[str, Any]


class VaultHTTPError(Exception):
    """Raised inside a handler to answer with Vault's error body; ``body`` replaces it when given."""

    def __init__(self, status: int, *errors: str, body: JsonObject | None = None) -> None:
        super().__init__(status, errors)
        self.status = status
        self.errors = list(errors)
        self.body = body


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the fake saw it. Tokens and bodies are never recorded."""

    method: str
    path: str
    query: str
    status: int
    at: float


@dataclass
class FakeToken:
    token_id: str
    accessor: str
    policies: list[str]
    ttl_seconds: int  # the TTL the token was created with; a renewal without increment restores it
    explicit_max_ttl_seconds: int
    renewable: bool
    issued_at: float
    expires_at: float | None  # None: never expires (root tokens)
    path: str
    display_name: str
    meta: dict[str, str] | None = None
    orphan: bool = False
    entity_id: str = ""
    last_renewal_at: float | None = None

    def remaining_seconds(self, now: float) -> int:
        if self.expires_at is None:
            return 0
        return max(0, round(self.expires_at - now))


@dataclass
class KubernetesRole:
    name: str
    service_account_names: list[str]
    service_account_namespaces: list[str]
    ttl_seconds: int
    max_ttl_seconds: int
    policies: list[str]
    audience: str | None = None


@dataclass
class _SecretVersion:
    data: JsonObject | None
    created_at: float
    deleted_at: float | None = None
    destroyed: bool = False


@dataclass
class _SecretEntry:
    created_at: float
    updated_at: float
    versions: dict[int, _SecretVersion] = field(default_factory=dict)
    current_version: int = 0
    oldest_version: int = 0
    max_versions: int = 0
    cas_required: bool = False
    custom_metadata: dict[str, str] | None = None


@dataclass
class _KvMount:
    max_versions: int = 0
    cas_required: bool = False
    delete_version_after: str = "0s"
    entries: dict[str, _SecretEntry] = field(default_factory=dict)


def rfc3339(at: float) -> str:
    """Vault's timestamp format: UTC, fractional seconds, trailing Z."""
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_duration_seconds(raw: object) -> int:
    """Vault accepts durations as integer seconds or Go duration strings ("90", "90s", "5m", "1h30m")."""
    if isinstance(raw, bool):
        raise ValueError(f"invalid duration {raw!r}")
    if isinstance(raw, int | float):
        return int(raw)
    if not isinstance(raw, str) or not raw:
        raise ValueError(f"invalid duration {raw!r}")
    if raw.isdigit():
        return int(raw)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", raw)
    if not parts or "".join(number + unit for number, unit in parts) != raw:
        raise ValueError(f"time: invalid duration {raw!r}")
    return int(sum(float(number) * units[unit] for number, unit in parts))


def make_service_account_jwt(
    service_account: str,
    namespace: str,
    *,
    uid: str | None = None,
    projected: bool = True,
    expires_at: float | None = None,
    audience: str | None = None,
) -> str:
    """A Kubernetes service-account token as the kubelet would mount it, signed with a junk signature.

    ``projected`` gives the claims of a bound (projected) token, otherwise those of a legacy secret-based
    token. The fake never checks the signature (see ``_Handler._kubernetes_login``).
    """

    def segment(payload: Mapping[str, object]) -> str:
        raw = json.dumps(payload, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    account_uid = uid or str(uuid.uuid4())
    claims: dict[str, object]
    if projected:
        claims = {
            "iss": "https://kubernetes.default.svc.cluster.local",
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "kubernetes.io": {
                "namespace": namespace,
                "serviceaccount": {"name": service_account, "uid": account_uid},
            },
        }
    else:
        claims = {
            "iss": "kubernetes/serviceaccount",
            "sub": f"system:serviceaccount:{namespace}:{service_account}",
            "kubernetes.io/serviceaccount/namespace": namespace,
            "kubernetes.io/serviceaccount/service-account.name": service_account,
            "kubernetes.io/serviceaccount/service-account.uid": account_uid,
            "kubernetes.io/serviceaccount/secret.name": f"{service_account}-token",
        }
    if expires_at is not None:
        claims["exp"] = int(expires_at)
    if audience is not None:
        claims["aud"] = [audience]
    signature = base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()
    return f"{segment({'alg': 'RS256', 'kid': 'fake'})}.{segment(claims)}.{signature}"


def _decode_jwt_claims(jwt: str) -> JsonObject:
    parts = jwt.split(".")
    if len(parts) != 3:
        raise ValueError("malformed JWT: expected three dot-separated parts")
    try:
        header = json.loads(base64.urlsafe_b64decode(parts[0] + "=" * (-len(parts[0]) % 4)))
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError) as error:
        raise ValueError("malformed JWT: header or claims are not base64url JSON") from error
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise ValueError("malformed JWT: header and claims must be JSON objects")
    if header.get("alg") in (None, "none", "HS256"):
        raise ValueError(f"unsupported signing algorithm {header.get('alg')!r}")
    return claims


def _service_account_from_claims(claims: JsonObject) -> tuple[str, str, str]:
    """(name, namespace, uid), preferring the projected-token claims as Vault's plugin does."""
    projected = claims.get("kubernetes.io")
    if isinstance(projected, dict) and isinstance(projected.get("serviceaccount"), dict):
        account = projected["serviceaccount"]
        return str(account.get("name", "")), str(projected.get("namespace", "")), str(account.get("uid", ""))
    return (
        str(claims.get("kubernetes.io/serviceaccount/service-account.name", "")),
        str(claims.get("kubernetes.io/serviceaccount/namespace", "")),
        str(claims.get("kubernetes.io/serviceaccount/service-account.uid", "")),
    )


def _glob_matches(patterns: Iterable[str], value: str) -> bool:
    return any(pattern == "*" or fnmatch.fnmatchcase(value, pattern) for pattern in patterns)


def _acl_pattern_matches(pattern: str, path: str) -> bool:
    """Vault ACL paths: a trailing ``*`` is a prefix match, ``+`` stands for exactly one segment."""
    prefix = pattern.endswith("*")
    body = pattern[:-1] if prefix else pattern
    regex = "^" + "[^/]+".join(re.escape(piece) for piece in body.split("+")) + (".*" if prefix else "$")
    return re.match(regex, path) is not None


class FakeVault:
    """A Vault server for tests. Thread-safe; every public method may be called while requests run."""

    def __init__(
        self, *, kv_mounts: Iterable[str] = ("secret",), kubernetes_mounts: Iterable[str] = ("kubernetes",)
    ):
        self._lock = threading.RLock()
        self._kv_mounts: dict[str, _KvMount] = {mount.strip("/"): _KvMount() for mount in kv_mounts}
        self._kubernetes_roles: dict[str, dict[str, KubernetesRole]] = {
            mount.strip("/"): {} for mount in kubernetes_mounts
        }
        self._tokens: dict[str, FakeToken] = {}
        self._policies: dict[str, dict[str, tuple[str, ...]]] = {DEFAULT_POLICY: dict(_DEFAULT_POLICY_RULES)}
        self._requests: list[RecordedRequest] = []
        self._server: ThreadingHTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        self._port = 0
        self._wake_stalled = threading.Event()
        self.cluster_id = str(uuid.uuid4())
        self.root_token = self._issue_token(
            policies=[ROOT_POLICY],
            ttl_seconds=0,
            renewable=False,
            path="auth/token/root",
            display_name="root",
        ).token_id
        # Test switches, read by the request handlers.
        self.fail_renewals = False
        self.sealed = False
        self.stall_seconds = 0.0

    # ---- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> FakeVault:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Listen on a free loopback port (the same one again after ``go_down``)."""
        with self._lock:
            if self._server is not None:
                return
            server = ThreadingHTTPServer(("127.0.0.1", self._port), _Handler)
            server.daemon_threads = True
            server.vault = self  # type: ignore[attr-defined]
            self._port = server.server_address[1]
            self._server = server
            self._wake_stalled.clear()
            self._serve_thread = threading.Thread(
                target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-vault", daemon=True
            )
            self._serve_thread.start()

    def stop(self) -> None:
        """Close the listener; state (secrets, tokens) is kept so ``start`` brings the same Vault back."""
        with self._lock:
            server, thread = self._server, self._serve_thread
            self._server = self._serve_thread = None
        if server is None:
            return
        self._wake_stalled.set()
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    go_down = stop
    come_back = start

    @contextmanager
    def unreachable(self) -> Iterator[None]:
        """Nothing listens on the port inside the block: clients get "connection refused"."""
        self.go_down()
        try:
            yield
        finally:
            self.come_back()

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # ---- KV v2 -----------------------------------------------------------------------------------

    def enable_kv(self, mount: str, *, max_versions: int = 0, cas_required: bool = False) -> None:
        with self._lock:
            self._kv_mounts[mount.strip("/")] = _KvMount(max_versions=max_versions, cas_required=cas_required)

    def put_secret(self, path: str, data: Mapping[str, Any], *, mount: str = "secret") -> int:
        """Write a new version (like ``vault kv put``) and return its number."""
        with self._lock:
            return self._write_version(self._kv_mounts[mount], path.strip("/"), dict(data), cas=None)

    def delete_secret_versions(self, path: str, versions: Iterable[int], *, mount: str = "secret") -> None:
        with self._lock:
            self._set_deleted(self._kv_mounts[mount], path.strip("/"), versions, deleted=True)

    def destroy_secret_versions(self, path: str, versions: Iterable[int], *, mount: str = "secret") -> None:
        with self._lock:
            self._destroy(self._kv_mounts[mount], path.strip("/"), versions)

    def current_version(self, path: str, *, mount: str = "secret") -> int:
        with self._lock:
            entry = self._kv_mounts[mount].entries.get(path.strip("/"))
            return 0 if entry is None else entry.current_version

    # ---- tokens, policies, kubernetes roles ------------------------------------------------------

    def add_policy(self, name: str, rules: Mapping[str, Iterable[str]]) -> None:
        """A policy as ``{path pattern: capabilities}``, e.g. ``{"secret/data/abada/*": ["read"]}``."""
        with self._lock:
            self._policies[name] = {pattern: tuple(capabilities) for pattern, capabilities in rules.items()}

    def create_token(
        self,
        ttl: float = 3600,
        renewable: bool = True,
        policies: Iterable[str] = (),
        *,
        explicit_max_ttl: float = 0,
        no_default_policy: bool = False,
        display_name: str = "token",
    ) -> str:
        """Like ``vault token create``; returns the token. ``ttl=0`` means Vault's default (768h)."""
        names = sorted(set(policies) | (set() if no_default_policy else {DEFAULT_POLICY}))
        with self._lock:
            token = self._issue_token(
                policies=names,
                ttl_seconds=int(ttl) or SYSTEM_MAX_TTL_SECONDS,
                renewable=renewable,
                explicit_max_ttl_seconds=int(explicit_max_ttl),
                path="auth/token/create",
                display_name=display_name,
            )
            return token.token_id

    def revoke_token(self, token_id: str) -> None:
        with self._lock:
            self._tokens.pop(token_id, None)

    def live_tokens(self) -> list[FakeToken]:
        """Every token that has neither expired nor been revoked, the root token included."""
        with self._lock:
            return [token for token in list(self._tokens.values()) if self._live_token(token.token_id)]

    def token_info(self, token_id: str) -> FakeToken | None:
        """The live token, or None once it expired or was revoked."""
        with self._lock:
            return self._live_token(token_id)

    def add_kubernetes_role(
        self,
        name: str,
        sa_names: Iterable[str],
        namespaces: Iterable[str],
        ttl: float = 3600,
        policies: Iterable[str] = (),
        *,
        max_ttl: float = 0,
        audience: str | None = None,
        mount: str = "kubernetes",
    ) -> None:
        with self._lock:
            self._kubernetes_roles.setdefault(mount.strip("/"), {})[name] = KubernetesRole(
                name=name,
                service_account_names=list(sa_names),
                service_account_namespaces=list(namespaces),
                ttl_seconds=int(ttl),
                max_ttl_seconds=int(max_ttl),
                policies=sorted(set(policies)),
                audience=audience,
            )

    # ---- request log -----------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def count(self, method: str, path: str, *, status: int | None = None) -> int:
        """How many ``method path`` requests (``path`` like ``/v1/auth/token/renew-self``) were answered."""
        with self._lock:
            return sum(
                1
                for request in self._requests
                if request.method == method.upper()
                and request.path == path
                and (status is None or request.status == status)
            )

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    # ---- internals (called with the lock held) ---------------------------------------------------

    def _record(self, method: str, path: str, query: str, status: int) -> None:
        with self._lock:
            self._requests.append(RecordedRequest(method, path, query, status, time.time()))

    def _issue_token(
        self,
        *,
        policies: list[str],
        ttl_seconds: int,
        renewable: bool,
        path: str,
        display_name: str,
        explicit_max_ttl_seconds: int = 0,
        meta: dict[str, str] | None = None,
        orphan: bool = False,
        entity_id: str = "",
    ) -> FakeToken:
        now = time.time()
        token = FakeToken(
            token_id="hvs." + secrets.token_urlsafe(24),
            accessor=secrets.token_urlsafe(18),
            policies=policies,
            ttl_seconds=ttl_seconds,
            explicit_max_ttl_seconds=explicit_max_ttl_seconds,
            renewable=renewable,
            issued_at=now,
            expires_at=None
            if ttl_seconds == 0
            else now + self._capped_ttl(ttl_seconds, explicit_max_ttl_seconds),
            path=path,
            display_name=display_name,
            meta=meta,
            orphan=orphan,
            entity_id=entity_id,
        )
        self._tokens[token.token_id] = token
        return token

    @staticmethod
    def _capped_ttl(ttl_seconds: int, explicit_max_ttl_seconds: int) -> int:
        limit = min(SYSTEM_MAX_TTL_SECONDS, explicit_max_ttl_seconds or SYSTEM_MAX_TTL_SECONDS)
        return min(ttl_seconds, limit)

    def _live_token(self, token_id: str) -> FakeToken | None:
        token = self._tokens.get(token_id)
        if token is not None and token.expires_at is not None and token.expires_at <= time.time():
            # Vault's expiration manager revokes a token when its lease runs out.
            del self._tokens[token_id]
            return None
        return token

    def _capabilities(self, token: FakeToken, path: str) -> set[str]:
        if ROOT_POLICY in token.policies:
            return {"create", "read", "update", "patch", "delete", "list", "sudo"}
        granted: set[str] = set()
        for name in token.policies:
            for pattern, capabilities in self._policies.get(name, {}).items():
                if _acl_pattern_matches(pattern, path):
                    if "deny" in capabilities:
                        return set()
                    granted.update(capabilities)
        return granted

    def _kv_mount_for(self, path: str) -> tuple[str, _KvMount, str] | None:
        for mount in sorted(self._kv_mounts, key=len, reverse=True):
            if path == mount or path.startswith(mount + "/"):
                return mount, self._kv_mounts[mount], path[len(mount) + 1 :]
        return None

    def _write_version(self, mount: _KvMount, key: str, data: JsonObject, cas: int | None) -> int:
        now = time.time()
        entry = mount.entries.get(key)
        current = 0 if entry is None else entry.current_version
        cas_required = mount.cas_required or (entry is not None and entry.cas_required)
        if cas is None and cas_required:
            raise VaultHTTPError(400, "check-and-set parameter required for this call")
        if cas is not None and cas != current:
            raise VaultHTTPError(400, "check-and-set parameter did not match the current version")
        if entry is None:
            entry = mount.entries[key] = _SecretEntry(created_at=now, updated_at=now)
        version = entry.current_version + 1
        entry.versions[version] = _SecretVersion(data=data, created_at=now)
        entry.current_version = version
        entry.updated_at = now
        if entry.oldest_version == 0:
            entry.oldest_version = 1
        keep = entry.max_versions or mount.max_versions or KV_DEFAULT_MAX_VERSIONS
        while len(entry.versions) > keep:
            del entry.versions[min(entry.versions)]
        entry.oldest_version = min(entry.versions)
        return version

    def _set_deleted(self, mount: _KvMount, key: str, versions: Iterable[int], *, deleted: bool) -> None:
        entry = mount.entries.get(key)
        if entry is None:
            return
        for number in versions:
            version = entry.versions.get(int(number))
            if version is not None and not version.destroyed:
                version.deleted_at = time.time() if deleted else None

    def _destroy(self, mount: _KvMount, key: str, versions: Iterable[int]) -> None:
        entry = mount.entries.get(key)
        if entry is None:
            return
        for number in versions:
            version = entry.versions.get(int(number))
            if version is not None:
                version.destroyed = True
                version.data = None

    @staticmethod
    def _version_metadata(entry: _SecretEntry, number: int) -> JsonObject:
        version = entry.versions[number]
        return {
            "created_time": rfc3339(version.created_at),
            "custom_metadata": entry.custom_metadata,
            "deletion_time": "" if version.deleted_at is None else rfc3339(version.deleted_at),
            "destroyed": version.destroyed,
            "version": number,
        }


class _Handler(BaseHTTPRequestHandler):
    server_version = "FakeVault"
    sys_version = ""

    @property
    def vault(self) -> FakeVault:
        return self.server.vault  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the fake keeps its own request log."""

    # http.server dispatches on do_<METHOD>; Vault also accepts the LIST verb.
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_LIST(self) -> None:
        self._dispatch("LIST")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = {name: values[-1] for name, values in parse_qs(url.query).items()}
        raw_body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.vault.stall_seconds > 0:
            self.vault._wake_stalled.wait(self.vault.stall_seconds)
        status, body = self._answer(method, path, query, raw_body)
        self.vault._record(method, path, url.query, status)
        self._send(status, body, head=method == "HEAD")

    def _answer(
        self, method: str, path: str, query: dict[str, str], raw_body: bytes
    ) -> tuple[int, JsonObject | None]:
        try:
            if not path.startswith("/v1/"):
                raise VaultHTTPError(404)
            logical = path[len("/v1/") :].strip("/")
            if logical == "sys/health":
                return self._health(method, query)
            if self.vault.sealed:
                raise VaultHTTPError(503, "Vault is sealed")
            if method == "GET" and query.get("list") == "true":
                method = "LIST"
            payload = self._json_body(raw_body)
            with self.vault._lock:
                return self._route(method, logical, query, payload)
        except VaultHTTPError as error:
            return error.status, error.body if error.body is not None else {"errors": error.errors}

    def _send(self, status: int, body: JsonObject | None, *, head: bool) -> None:
        encoded = b"" if body is None else json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Cache-Control", "no-store")
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(encoded)))
            self.end_headers()
            if not head and encoded:
                self.wfile.write(encoded)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (it timed out on a stalled answer): nobody is left to answer

    @staticmethod
    def _json_body(raw_body: bytes) -> JsonObject:
        if not raw_body.strip():
            return {}
        try:
            payload = json.loads(raw_body)
        except ValueError as error:
            raise VaultHTTPError(400, f"failed to parse JSON input: {error}") from error
        if not isinstance(payload, dict):
            raise VaultHTTPError(400, "failed to parse JSON input: body must be a JSON object")
        return payload

    # ---- routing ---------------------------------------------------------------------------------

    def _route(
        self, method: str, path: str, query: dict[str, str], payload: JsonObject
    ) -> tuple[int, JsonObject | None]:
        for mount in self.vault._kubernetes_roles:
            if path == f"auth/{mount}/login":
                # Login paths are unauthenticated: Vault ignores any token sent along.
                self._require_method(method, "POST", "PUT")
                return self._kubernetes_login(mount, payload)

        token = self._authenticate()
        operation = {
            "GET": "read",
            "HEAD": "read",
            "LIST": "list",
            "DELETE": "delete",
            "POST": "update",
            "PUT": "update",
            "PATCH": "patch",
        }[method]
        capabilities = self.vault._capabilities(token, path)
        if operation == "update" and "create" in capabilities:
            capabilities.add("update")  # create-vs-update depends on existence; grant either
        if operation not in capabilities:
            raise VaultHTTPError(403, _ERR_POLICY_DENIED)

        if path == "auth/token/lookup-self":
            self._require_method(method, "GET", "POST")
            return 200, self._envelope(data=self._token_data(token), mount_type="token")
        if path == "auth/token/renew-self":
            self._require_method(method, "POST", "PUT")
            return self._renew_self(token, payload)
        if path == "auth/token/revoke-self":
            self._require_method(method, "POST", "PUT")
            self.vault._tokens.pop(token.token_id, None)
            return 204, None

        mounted = self.vault._kv_mount_for(path)
        if mounted is None:
            raise VaultHTTPError(404, f'no handler for route "{path}". route entry not found.')
        return self._kv(method, query, payload, *mounted)

    def _authenticate(self) -> FakeToken:
        token_id = self.headers.get("X-Vault-Token")
        if not token_id:
            authorization = self.headers.get("Authorization", "")
            token_id = authorization[len("Bearer ") :] if authorization.startswith("Bearer ") else ""
        if not token_id:
            raise VaultHTTPError(403, _ERR_NO_TOKEN)
        token = self.vault._live_token(token_id)
        if token is None:
            raise VaultHTTPError(403, _ERR_BAD_TOKEN)
        return token

    @staticmethod
    def _require_method(method: str, *allowed: str) -> None:
        if method not in allowed:
            raise VaultHTTPError(405, _ERR_UNSUPPORTED)

    def _envelope(
        self,
        *,
        data: JsonObject | None = None,
        auth: JsonObject | None = None,
        warnings: list[str] | None = None,
        mount_type: str = "",
    ) -> JsonObject:
        return {
            "request_id": str(uuid.uuid4()),
            "lease_id": "",
            "renewable": False,
            "lease_duration": 0,
            "data": data,
            "wrap_info": None,
            "warnings": warnings or None,
            "auth": auth,
            "mount_type": mount_type,
        }

    # ---- sys/health ------------------------------------------------------------------------------

    def _health(self, method: str, query: dict[str, str]) -> tuple[int, JsonObject | None]:
        if method not in ("GET", "HEAD"):
            raise VaultHTTPError(405)
        sealed = self.vault.sealed
        default_status = 503 if sealed else 200
        code_param = "sealedcode" if sealed else "activecode"
        try:
            status = int(query.get(code_param, default_status))
        except ValueError as error:
            raise VaultHTTPError(400, f"bad code value {query[code_param]!r}") from error
        now = time.time()
        body = {
            "initialized": True,
            "sealed": sealed,
            "standby": False,
            "performance_standby": False,
            "replication_performance_mode": "disabled",
            "replication_dr_mode": "disabled",
            "server_time_utc": int(now),
            "version": VAULT_VERSION,
            "enterprise": False,
            "cluster_name": "vault-cluster-fake",
            "cluster_id": self.vault.cluster_id,
            "echo_duration_ms": 0,
            "clock_skew_ms": 0,
            "replication_primary_canary_age_ms": 0,
        }
        return status, body

    # ---- token auth ------------------------------------------------------------------------------

    def _token_data(self, token: FakeToken) -> JsonObject:
        now = time.time()
        data: JsonObject = {
            "accessor": token.accessor,
            "creation_time": int(token.issued_at),
            "creation_ttl": token.ttl_seconds,
            "display_name": token.display_name,
            "entity_id": token.entity_id,
            "expire_time": None if token.expires_at is None else rfc3339(token.expires_at),
            "explicit_max_ttl": token.explicit_max_ttl_seconds,
            "id": token.token_id,
            "identity_policies": None,
            "issue_time": rfc3339(token.issued_at),
            "meta": token.meta,
            "num_uses": 0,
            "orphan": token.orphan,
            "path": token.path,
            "policies": token.policies,
            "renewable": token.renewable,
            "ttl": token.remaining_seconds(now),
            "type": "service",
        }
        if token.last_renewal_at is not None:
            data["last_renewal"] = rfc3339(token.last_renewal_at)
            data["last_renewal_time"] = int(token.last_renewal_at)
        return data

    def _auth_block(self, token: FakeToken, lease_duration: int) -> JsonObject:
        return {
            "client_token": token.token_id,
            "accessor": token.accessor,
            "policies": token.policies,
            "token_policies": token.policies,
            "identity_policies": None,
            "metadata": token.meta,
            "lease_duration": lease_duration,
            "renewable": token.renewable,
            "entity_id": token.entity_id,
            "token_type": "service",
            "orphan": token.orphan,
            "mfa_requirement": None,
            "num_uses": 0,
        }

    def _renew_self(self, token: FakeToken, payload: JsonObject) -> tuple[int, JsonObject]:
        if self.vault.fail_renewals:
            raise VaultHTTPError(
                500, "1 error occurred:\n\t* failed to renew entry: storage backend unavailable\n\n"
            )
        if not token.renewable or token.expires_at is None:
            raise VaultHTTPError(400, "lease is not renewable")
        increment = 0
        if payload.get("increment") not in (None, "", 0):
            try:
                increment = parse_duration_seconds(payload["increment"])
            except ValueError as error:
                raise VaultHTTPError(400, str(error)) from error
        # Vault's framework.CalculateTTL: the new TTL counts from now (not from the old expiry), defaults
        # to the token's own TTL, and may never pass issue time + the effective max TTL.
        now = time.time()
        ttl = increment or token.ttl_seconds
        max_ttl = min(SYSTEM_MAX_TTL_SECONDS, token.explicit_max_ttl_seconds or SYSTEM_MAX_TTL_SECONDS)
        max_valid_until = token.issued_at + max_ttl
        if max_valid_until <= now:
            raise VaultHTTPError(500, "past the max TTL, cannot renew")
        warnings = []
        if now + ttl > max_valid_until:
            left = int(max_valid_until - now)
            warnings.append(
                f'TTL of "{ttl}s" exceeded the effective max_ttl of "{left}s"; TTL value is capped accordingly'
            )
            ttl = left
        token.expires_at = now + ttl
        token.last_renewal_at = now
        return 200, self._envelope(auth=self._auth_block(token, ttl), warnings=warnings, mount_type="token")

    # ---- kubernetes auth -------------------------------------------------------------------------

    def _kubernetes_login(self, mount: str, payload: JsonObject) -> tuple[int, JsonObject]:
        role_name = payload.get("role")
        if not isinstance(role_name, str) or not role_name:
            raise VaultHTTPError(400, "missing role")
        jwt = payload.get("jwt")
        if not isinstance(jwt, str) or not jwt:
            raise VaultHTTPError(400, "missing jwt")
        role = self.vault._kubernetes_roles[mount].get(role_name)
        if role is None:
            raise VaultHTTPError(400, f'invalid role name "{role_name}"')
        # Real Vault verifies the JWT's signature (when configured with keys) and then asks the Kubernetes
        # TokenReview API whether the token is genuine and still valid. The fake has no API server: it
        # trusts the claims and only checks them against the role's bindings, expiry and audience.
        try:
            claims = _decode_jwt_claims(jwt)
        except ValueError as error:
            raise VaultHTTPError(403, str(error)) from error
        expires = claims.get("exp")
        if isinstance(expires, int | float) and expires <= time.time():
            raise VaultHTTPError(403, "token is expired")
        if role.audience is not None:
            audiences = claims.get("aud")
            audiences = [audiences] if isinstance(audiences, str) else audiences or []
            if role.audience not in audiences:
                raise VaultHTTPError(
                    403, "invalid audience (aud) claim: audience claim does not match any expected audience"
                )
        name, namespace, uid = _service_account_from_claims(claims)
        if not _glob_matches(role.service_account_names, name):
            raise VaultHTTPError(403, "service account name not authorized")
        if not _glob_matches(role.service_account_namespaces, namespace):
            raise VaultHTTPError(403, "namespace not authorized")
        if not uid:
            raise VaultHTTPError(500, "could not parse UID from claims")
        metadata = {
            "role": role_name,
            "service_account_name": name,
            "service_account_namespace": namespace,
            "service_account_secret_name": "",
            "service_account_uid": uid,
        }
        ttl = role.ttl_seconds or SYSTEM_MAX_TTL_SECONDS
        token = self.vault._issue_token(
            policies=sorted(set(role.policies) | {DEFAULT_POLICY}),
            ttl_seconds=ttl,
            renewable=True,
            explicit_max_ttl_seconds=role.max_ttl_seconds,
            path=f"auth/{mount}/login",
            display_name=f"{mount}-{namespace}-{name}",
            meta=metadata,
            orphan=True,
            entity_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"{mount}/{uid}")),
        )
        lease = token.remaining_seconds(time.time())
        return 200, self._envelope(auth=self._auth_block(token, lease), mount_type="kubernetes")

    # ---- KV v2 -----------------------------------------------------------------------------------

    def _kv(
        self,
        method: str,
        query: dict[str, str],
        payload: JsonObject,
        mount_name: str,
        mount: _KvMount,
        rest: str,
    ) -> tuple[int, JsonObject | None]:
        section, _, key = rest.partition("/")
        key = key.strip("/")
        if section == "config" and not key:
            return self._kv_config(method, payload, mount)
        if section not in ("data", "metadata", "delete", "undelete", "destroy"):
            raise VaultHTTPError(404, f'no handler for route "{mount_name}/{rest}". route entry not found.')
        if not key and not (section == "metadata" and method == "LIST"):
            raise VaultHTTPError(404, f'no handler for route "{mount_name}/{rest}". route entry not found.')
        if section == "data":
            return self._kv_data(method, query, payload, mount, key)
        if section == "metadata":
            return self._kv_metadata(method, payload, mount, key)
        self._require_method(method, "POST", "PUT")
        versions = payload.get("versions")
        if not isinstance(versions, list) or not versions:
            raise VaultHTTPError(400, "no version number provided")
        if not all(isinstance(number, int) and not isinstance(number, bool) for number in versions):
            raise VaultHTTPError(400, "versions must be integers")
        if section == "destroy":
            self.vault._destroy(mount, key, versions)
        else:
            self.vault._set_deleted(mount, key, versions, deleted=section == "delete")
        return 204, None

    def _kv_config(self, method: str, payload: JsonObject, mount: _KvMount) -> tuple[int, JsonObject | None]:
        if method == "GET":
            data = {
                "cas_required": mount.cas_required,
                "delete_version_after": mount.delete_version_after,
                "max_versions": mount.max_versions,
            }
            return 200, self._envelope(data=data, mount_type="kv")
        self._require_method(method, "POST", "PUT")
        if "max_versions" in payload:
            mount.max_versions = int(payload["max_versions"])
        if "cas_required" in payload:
            mount.cas_required = bool(payload["cas_required"])
        return 204, None

    def _kv_data(
        self, method: str, query: dict[str, str], payload: JsonObject, mount: _KvMount, key: str
    ) -> tuple[int, JsonObject | None]:
        entry = mount.entries.get(key)
        if method == "GET":
            raw_version = query.get("version", "0")
            try:
                number = int(raw_version)
            except ValueError as error:
                raise VaultHTTPError(
                    400, f'error converting input {raw_version} for field "version": invalid syntax'
                ) from error
            if entry is None:
                raise VaultHTTPError(404)
            number = number or entry.current_version
            if number not in entry.versions:
                raise VaultHTTPError(404)
            version = entry.versions[number]
            metadata = self.vault._version_metadata(entry, number)
            if version.deleted_at is not None or version.destroyed:
                # Vault answers 404 but still sends the version's metadata, so clients can tell why.
                envelope = self._envelope(data={"data": None, "metadata": metadata}, mount_type="kv")
                raise VaultHTTPError(404, body=envelope)
            return 200, self._envelope(data={"data": version.data, "metadata": metadata}, mount_type="kv")
        if method in ("POST", "PUT"):
            data = payload.get("data")
            if data is None:
                raise VaultHTTPError(400, "no data provided")
            if not isinstance(data, dict):
                raise VaultHTTPError(400, "data must be a JSON object")
            options = payload.get("options") or {}
            if not isinstance(options, dict):
                raise VaultHTTPError(400, "options must be a JSON object")
            cas = options.get("cas")
            if cas is not None and (isinstance(cas, bool) or not isinstance(cas, int)):
                raise VaultHTTPError(400, "cas must be an integer")
            number = self.vault._write_version(mount, key, data, cas)
            return 200, self._envelope(
                data=self.vault._version_metadata(mount.entries[key], number), mount_type="kv"
            )
        if method == "DELETE":
            if entry is not None and entry.current_version in entry.versions:
                self.vault._set_deleted(mount, key, [entry.current_version], deleted=True)
            return 204, None
        raise VaultHTTPError(405, _ERR_UNSUPPORTED)

    def _kv_metadata(
        self, method: str, payload: JsonObject, mount: _KvMount, key: str
    ) -> tuple[int, JsonObject | None]:
        if method == "LIST":
            prefix = key + "/" if key else ""
            children = {
                name[len(prefix) :].split("/", 1)[0] + ("/" if "/" in name[len(prefix) :] else "")
                for name in mount.entries
                if name.startswith(prefix)
            }
            if not children:
                raise VaultHTTPError(404)
            return 200, self._envelope(data={"keys": sorted(children)}, mount_type="kv")
        entry = mount.entries.get(key)
        if method == "GET":
            if entry is None:
                raise VaultHTTPError(404)
            data = {
                "cas_required": entry.cas_required,
                "created_time": rfc3339(entry.created_at),
                "current_version": entry.current_version,
                "custom_metadata": entry.custom_metadata,
                "delete_version_after": "0s",
                "max_versions": entry.max_versions,
                "oldest_version": entry.oldest_version,
                "updated_time": rfc3339(entry.updated_at),
                "versions": {
                    str(number): {
                        key_: value
                        for key_, value in self.vault._version_metadata(entry, number).items()
                        if key_ in ("created_time", "deletion_time", "destroyed")
                    }
                    for number in sorted(entry.versions)
                },
            }
            return 200, self._envelope(data=data, mount_type="kv")
        if method == "DELETE":
            mount.entries.pop(key, None)
            return 204, None
        if method in ("POST", "PUT"):
            now = time.time()
            if entry is None:
                entry = mount.entries[key] = _SecretEntry(created_at=now, updated_at=now)
            if "max_versions" in payload:
                entry.max_versions = int(payload["max_versions"])
            if "cas_required" in payload:
                entry.cas_required = bool(payload["cas_required"])
            if "custom_metadata" in payload:
                custom = payload["custom_metadata"]
                if not isinstance(custom, dict):
                    raise VaultHTTPError(400, "custom_metadata must be a map of strings")
                entry.custom_metadata = {str(name): str(value) for name, value in custom.items()}
            entry.updated_at = now
            return 204, None
        raise VaultHTTPError(405, _ERR_UNSUPPORTED)


__all__ = [
    "DEFAULT_POLICY",
    "ROOT_POLICY",
    "VAULT_VERSION",
    "FakeToken",
    "FakeVault",
    "KubernetesRole",
    "RecordedRequest",
    "make_service_account_jwt",
    "parse_duration_seconds",
    "rfc3339",
]
