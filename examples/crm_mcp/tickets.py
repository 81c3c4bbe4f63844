"""Support tickets in a SQLite file, with idempotency keys checked and recorded atomically."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel

FIRST_TICKET_NUMBER = 981
TICKET_PRIORITIES = ("low", "normal", "high", "urgent")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    number          INTEGER PRIMARY KEY,
    customer_id     TEXT NOT NULL,
    subject         TEXT NOT NULL,
    priority        TEXT NOT NULL,
    channel         TEXT,
    status          TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    idempotency_key TEXT UNIQUE,
    request_json    TEXT NOT NULL
)
"""


class Ticket(BaseModel):
    """A ticket as create_ticket returns it (extra fields of the subclasses are dropped on validation)."""

    ticketId: str
    customerId: str
    subject: str
    priority: str
    status: str
    createdAt: str


class TicketWithChannel(Ticket):
    channel: str | None


class StoredTicket(TicketWithChannel):
    """A ticket as the operator listing shows it: with the key it was created under."""

    idempotencyKey: str | None


@dataclass(frozen=True)
class TicketRequest:
    customer_id: str
    subject: str
    priority: str
    channel: str | None = None

    def as_json_dict(self) -> dict[str, str | None]:
        return {
            "customerId": self.customer_id,
            "subject": self.subject,
            "priority": self.priority,
            "channel": self.channel,
        }


@dataclass(frozen=True)
class TicketOutcome:
    ticket: StoredTicket
    replayed: bool  # True when an earlier call with the same idempotency key already created it


class IdempotencyConflictError(Exception):
    """The idempotency key was already used for a request with different arguments."""

    def __init__(self, key: str, differing_fields: list[str]) -> None:
        self.key = key
        self.differing_fields = differing_fields
        super().__init__(
            f"Idempotency key {key!r} was already used for a create_ticket call with different arguments "
            f"(differs in: {', '.join(differing_fields)}). No ticket was created. Retry with the original "
            "arguments, or use a new idempotency key for a new ticket."
        )


def _ticket_id(number: int) -> str:
    return f"T-{number}"


def _canonical(request: TicketRequest) -> str:
    return json.dumps(request.as_json_dict(), sort_keys=True, separators=(",", ":"))


class TicketStore:
    """Opens one SQLite connection per operation, so it is safe to call from worker threads."""

    def __init__(self, db_path: Path) -> None:
        self.db_path = db_path
        db_path.parent.mkdir(parents=True, exist_ok=True)
        with self._connection() as connection:
            # WAL lets readers (GET /tickets, a test counting rows) run while a ticket is being written.
            connection.execute("PRAGMA journal_mode=WAL")
            connection.execute(_SCHEMA)

    @contextmanager
    def _connection(self) -> Iterator[sqlite3.Connection]:
        # isolation_level=None: we issue BEGIN ourselves, so the transaction boundaries are explicit.
        connection = sqlite3.connect(self.db_path, timeout=10.0, isolation_level=None)
        connection.row_factory = sqlite3.Row
        try:
            yield connection
        finally:
            connection.close()

    def create(self, request: TicketRequest, idempotency_key: str | None) -> TicketOutcome:
        """Create a ticket, or return the one an earlier call with the same key created.

        BEGIN IMMEDIATE takes the write lock before the key is looked up, so two concurrent calls with
        one key (from threads or from other processes on the same file) cannot both insert.
        """
        request_json = _canonical(request)
        with self._connection() as connection:
            connection.execute("BEGIN IMMEDIATE")
            try:
                if idempotency_key is not None:
                    existing = connection.execute(
                        "SELECT * FROM tickets WHERE idempotency_key = ?", (idempotency_key,)
                    ).fetchone()
                    if existing is not None:
                        connection.execute("COMMIT")
                        if existing["request_json"] != request_json:
                            raise IdempotencyConflictError(
                                idempotency_key, _differing_fields(existing["request_json"], request)
                            )
                        return TicketOutcome(ticket=_ticket_from_row(existing), replayed=True)
                (highest,) = connection.execute("SELECT MAX(number) FROM tickets").fetchone()
                number = FIRST_TICKET_NUMBER if highest is None else highest + 1
                created_at = datetime.now(UTC).isoformat(timespec="seconds")
                connection.execute(
                    "INSERT INTO tickets (number, customer_id, subject, priority, channel, status,"
                    " created_at, idempotency_key, request_json) VALUES (?, ?, ?, ?, ?, 'open', ?, ?, ?)",
                    (
                        number,
                        request.customer_id,
                        request.subject,
                        request.priority,
                        request.channel,
                        created_at,
                        idempotency_key,
                        request_json,
                    ),
                )
                row = connection.execute("SELECT * FROM tickets WHERE number = ?", (number,)).fetchone()
                connection.execute("COMMIT")
            except BaseException:
                if connection.in_transaction:
                    connection.execute("ROLLBACK")
                raise
        return TicketOutcome(ticket=_ticket_from_row(row), replayed=False)

    def clear(self) -> None:
        """Forget every ticket and idempotency key: numbering starts again at the first ticket."""
        with self._connection() as connection:
            connection.execute("DELETE FROM tickets")

    def list_tickets(self) -> list[StoredTicket]:
        with self._connection() as connection:
            rows = connection.execute("SELECT * FROM tickets ORDER BY number").fetchall()
        return [_ticket_from_row(row) for row in rows]


def _ticket_from_row(row: sqlite3.Row) -> StoredTicket:
    return StoredTicket(
        ticketId=_ticket_id(row["number"]),
        customerId=row["customer_id"],
        subject=row["subject"],
        priority=row["priority"],
        status=row["status"],
        createdAt=row["created_at"],
        channel=row["channel"],
        idempotencyKey=row["idempotency_key"],
    )


def _differing_fields(stored_request_json: str, request: TicketRequest) -> list[str]:
    stored = json.loads(stored_request_json)
    incoming = request.as_json_dict()
    return sorted(name for name in incoming.keys() | stored.keys() if stored.get(name) != incoming.get(name))
