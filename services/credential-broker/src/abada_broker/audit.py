"""The audit trail: one structured event per credential issued or refused, on logger ``abada_broker.audit``.

Every event has the same keys (absent values are null), so a log pipeline can index them::

    {"event": "credential.issued" | "credential.refused", "purpose": "task" | "deploy",
     "task_id", "worker_id", "caller", "on_behalf_of", "peer", "server", "url", "credential", "version",
     "attempt", "expire_time", "outcome", "reason"}

``on_behalf_of`` is the operator whose deploy the engine (``caller``) asked for; ``url`` is where the
credential is to be sent.

An event never holds a secret value, a lease token or a bearer token: :class:`AuditRecord` has no field
for any of them.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import asdict, dataclass
from typing import Literal

from .errors import BrokerError
from .metrics import CREDENTIALS

AUDIT_LOGGER = "abada_broker.audit"
ISSUED = "credential.issued"
REFUSED = "credential.refused"
# Request fields are echoed into the trail; a caller must not be able to flood it through them.
_MAX_ECHOED_CHARS = 256

Purpose = Literal["task", "deploy"]


def _echo(value: str | None) -> str | None:
    if value is None or len(value) <= _MAX_ECHOED_CHARS:
        return value
    return value[:_MAX_ECHOED_CHARS] + "…"


@dataclass
class AuditRecord:
    """What is known about one request so far; filled in as the request passes each check."""

    purpose: Purpose
    peer: str | None = None
    task_id: str | None = None
    worker_id: str | None = None
    caller: str | None = None
    on_behalf_of: str | None = None
    server: str | None = None
    url: str | None = None
    credential: str | None = None
    version: int | None = None
    attempt: int | None = None


class AuditLog:
    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._logger = logger or logging.getLogger(AUDIT_LOGGER)

    def issued(self, record: AuditRecord, *, expire_time: dt.datetime | None) -> None:
        self._write(
            ISSUED,
            record,
            outcome="issued",
            reason=None,
            expire_time=None if expire_time is None else expire_time.isoformat(timespec="milliseconds"),
        )

    def refused(self, record: AuditRecord, error: BrokerError) -> None:
        self._write(REFUSED, record, outcome=error.outcome.value, reason=error.reason_name, expire_time=None)

    def _write(
        self, event: str, record: AuditRecord, *, outcome: str, reason: str | None, expire_time: str | None
    ) -> None:
        fields = {
            name: _echo(value) if isinstance(value, str) else value for name, value in asdict(record).items()
        }
        fields.update(event=event, outcome=outcome, reason=reason, expire_time=expire_time)
        CREDENTIALS.labels(record.purpose, outcome).inc()
        message = f"{event} ({record.purpose})" + (f": {reason}" if reason else "")
        self._logger.info(message, extra=fields)
