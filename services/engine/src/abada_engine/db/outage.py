"""Telling "PostgreSQL cannot be reached" apart from every other failure of a statement.

A caller can do something about the first (try again shortly: UNAVAILABLE), and nothing about the
second (INTERNAL). The pool recovers by itself: SQLAlchemy drops every pooled connection when one
reports a disconnect, and the next checkout connects afresh.
"""

from __future__ import annotations

import asyncpg
from sqlalchemy import exc as sa_exc

# asyncpg's own: the server going away, refusing connections while it starts or stops, or the
# connection object already closed under us. InternalClientError is how asyncpg refuses the next
# statement on a connection whose session the server ended while it sat idle (its protocol still
# holds the server's unsolicited farewell); the statement was not sent.
_DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.ConnectionDoesNotExistError,
    asyncpg.InterfaceError,
    ConnectionError,
    TimeoutError,
    OSError,
)


def database_unreachable(error: BaseException) -> bool:
    """True when `error` (or what caused it) says the database is out of reach, not that a statement failed."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        if isinstance(current, sa_exc.TimeoutError | sa_exc.DisconnectionError):
            return True  # no pooled connection came free in time, or a checkout found it dead
        if isinstance(current, _DRIVER_ERRORS):
            return True
        if isinstance(current, sa_exc.DBAPIError) and isinstance(current.orig, BaseException):
            orig = current.orig
            inner = getattr(orig, "__cause__", None)
            if isinstance(orig, _DRIVER_ERRORS) or (inner is not None and isinstance(inner, _DRIVER_ERRORS)):
                return True
        current = current.__cause__ or current.__context__
    return False


# SQLSTATEs of a value PostgreSQL cannot store as text: a NUL character (22P05) or one the database
# encoding lacks (22021). The caller sent it; nothing about the database is wrong.
_UNSTORABLE_TEXT = frozenset({"22P05", "22021"})


def unstorable_text(error: BaseException) -> bool:
    """True when `error` (or what caused it) is PostgreSQL refusing a character of a value it was given."""
    return _sqlstate_in(error, _UNSTORABLE_TEXT)


# Two transactions that met on the same rows: PostgreSQL rolled this one back (a deadlock, or a
# serialization failure), and the same call sent again goes through.
_CONFLICTED = frozenset({"40P01", "40001"})


def conflicted(error: BaseException) -> bool:
    """True when `error` (or what caused it) is PostgreSQL rolling the statement back for meeting
    another transaction at the same moment: nothing of it was written, and sending it again is safe."""
    return _sqlstate_in(error, _CONFLICTED)


def _sqlstate_in(error: BaseException, states: frozenset[str]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if getattr(current, "sqlstate", None) in states:
            return True
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else (current.__cause__ or current.__context__)
    return False
