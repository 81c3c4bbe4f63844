"""Who may call the engine: callers, their roles and what they may do.

Callers are listed in a YAML file (ABADA_AUTH_TOKENS_FILE), re-read when it changes (looked at
no more than once a second, not on every request):

    callers:
      - identity: agent-pool            # worker ids "agent-pool" or "agent-pool/<anything>"
        roles: [worker]
        topics: ["abada:agent"]         # "*" for every topic
        token_sha256: <hex SHA-256 of the bearer token>
      - identity: abada-broker
        roles: [broker]
        certificate_cn: abada-broker    # with mTLS: the client certificate's common name
      - identity: alice
        roles: [operator]
        token_sha256: <hex>
      - identity: helpdesk-webhook
        roles: [publisher]
        messages: [customer_reply]      # the message names it may publish ("*" for any)
        token_sha256: <hex>

Roles: `worker` (fetch, lease, journal and finish tasks of its topics), `operator` (deploy,
instances, incidents, journals, approvals), `approver` (list and decide approvals of tool calls,
nothing else), `broker` (VerifyLease), `metrics` (the HTTP queue-depth endpoint, for autoscalers),
`publisher` (PublishMessage of the message names it lists, nothing else).
Tokens are stored only hashed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import pathlib
import secrets
import time
from dataclasses import dataclass

import yaml
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import Category, EngineError
from abada_engine.private_files import write_private

log = logging.getLogger(__name__)

ROLES = ("worker", "operator", "approver", "broker", "metrics", "publisher")


@dataclass(frozen=True)
class Caller:
    identity: str
    roles: frozenset[str]
    topics: frozenset[str] = frozenset()
    # A trusted test or development identity that may act under any worker id; never the default.
    act_as_any_worker: bool = False
    # A publisher's messages: the names it may publish (an operator may publish any).
    messages: frozenset[str] = frozenset()

    def may_publish(self, name: str) -> bool:
        return "operator" in self.roles or "*" in self.messages or name in self.messages

    def may_act_as(self, worker_id: str) -> bool:
        # `identity` or `identity/<name>` with a name: the same rule as the broker's.
        prefix = self.identity + "/"
        return (
            self.act_as_any_worker
            or worker_id == self.identity
            or (worker_id.startswith(prefix) and len(worker_id) > len(prefix))
        )

    def may_fetch(self, topic: str) -> bool:
        return "*" in self.topics or topic in self.topics


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# How often the callers file is looked at for a change: a stat() per request cost ~4% of the engine.
RECHECK_SECONDS = 1.0


class CallerRegistry:
    def __init__(self, path: pathlib.Path, recheck_seconds: float = RECHECK_SECONDS) -> None:
        self._path = path
        self._recheck_seconds = recheck_seconds
        self._checked_at = -math.inf
        self._stamp: tuple[int, int] | None = None
        self._by_token: dict[str, Caller] = {}
        self._by_certificate: dict[str, Caller] = {}
        self._reload_if_changed()

    def by_token(self, token: str) -> Caller | None:
        self._reload_if_changed()
        digest = token_sha256(token)
        for known, caller in self._by_token.items():
            if hmac.compare_digest(known, digest):
                return caller
        return None

    def by_certificate(self, common_name: str) -> Caller | None:
        self._reload_if_changed()
        return self._by_certificate.get(common_name)

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked_at < self._recheck_seconds:
            return
        self._checked_at = now
        try:
            stat = self._path.stat()
        except OSError:
            if self._stamp is None:
                raise
            return  # a file being replaced or briefly missing: keep what we know
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        try:
            by_token, by_certificate = _parse(self._path)
        except (OSError, ValueError, yaml.YAMLError, AttributeError, TypeError) as error:
            if self._stamp is None:
                raise
            # A broken edit must not lock every caller out: keep the last good list and say why.
            log.error(
                "the callers file is invalid; keeping the previous list",
                extra={"path": str(self._path), "error": str(error)[:300]},
            )
            self._stamp = stamp
            return
        self._by_token, self._by_certificate, self._stamp = by_token, by_certificate, stamp
        log.info(
            "caller list loaded",
            extra={"path": str(self._path), "callers": len(by_token) + len(by_certificate)},
        )


def _parse(path: pathlib.Path) -> tuple[dict[str, Caller], dict[str, Caller]]:
    data = yaml.safe_load(path.read_text()) or {}
    by_token: dict[str, Caller] = {}
    by_certificate: dict[str, Caller] = {}
    for index, entry in enumerate(data.get("callers", [])):
        where = f"{path}: callers[{index}]"
        identity = entry.get("identity")
        roles = frozenset(entry.get("roles", []))
        if not identity or not roles or not roles <= set(ROLES):
            raise ValueError(f"{where}: needs an identity and roles from {', '.join(ROLES)}")
        caller = Caller(
            identity,
            roles,
            frozenset(entry.get("topics", [])),
            bool(entry.get("act_as_any_worker")),
            frozenset(entry.get("messages", [])),
        )
        digest = entry.get("token_sha256")
        common_name = entry.get("certificate_cn")
        if not digest and not common_name:
            raise ValueError(f"{where}: give token_sha256 or certificate_cn")
        if digest:
            by_token[str(digest).lower()] = caller
        if common_name:
            by_certificate[str(common_name)] = caller
    return by_token, by_certificate


def require_role(caller: Caller, role: str | tuple[str, ...], what: str) -> None:
    """The caller has `role` (or, given several, any one of them)."""
    accepted = (role,) if isinstance(role, str) else role
    if not caller.roles & set(accepted):
        raise EngineError(
            Category.PERMISSION_DENIED,
            ErrorReason.ROLE_REQUIRED,
            f"{caller.identity!r} may not call {what}: it needs the {' or '.join(accepted)} role",
            metadata={"role": accepted[0]},
        )


def require_worker(caller: Caller | None, worker_id: str, topics: list[str] | None = None) -> None:
    """The worker id in a request must be the caller's own; fetched topics must be granted."""
    if caller is None:
        return
    if not caller.may_act_as(worker_id):
        raise EngineError(
            Category.PERMISSION_DENIED,
            ErrorReason.WORKER_ID_MISMATCH,
            f"you are authenticated as {caller.identity!r} and may not act as worker {worker_id!r}",
            field="worker_id",
        )
    for index, topic in enumerate(topics or []):
        if not caller.may_fetch(topic):
            raise EngineError(
                Category.PERMISSION_DENIED,
                ErrorReason.TOPIC_NOT_ALLOWED,
                f"{caller.identity!r} may not work on topic {topic!r}",
                field=f"topics[{index}].name",
            )


def write_dev_callers(directory: pathlib.Path) -> pathlib.Path:
    """Development callers: an operator, an approver, a worker pool and the broker, with their tokens in files."""
    directory.mkdir(parents=True, exist_ok=True)
    registry = directory / "callers.yaml"
    if registry.exists():
        return registry
    entries = []
    for name, identity, roles, topics in (
        ("operator", "dev-operator", ["operator"], []),
        ("approver", "dev-approver", ["approver"], []),
        ("worker", "dev-worker", ["worker"], ["*"]),
        ("broker", "dev-broker", ["broker"], []),
    ):
        token = secrets.token_urlsafe(32)
        token_file = directory / f"{name}.token"
        write_private(token_file, token + "\n")
        entries.append(
            {"identity": identity, "roles": roles, "topics": topics, "token_sha256": token_sha256(token)}
        )
    write_private(registry, yaml.safe_dump({"callers": entries}, sort_keys=False))
    return registry
