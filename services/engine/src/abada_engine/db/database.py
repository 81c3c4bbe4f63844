"""The connection to PostgreSQL: an async SQLAlchemy engine over asyncpg."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def _json_default(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), default=_json_default)


def async_url(url: str) -> str:
    """Accept plain `postgresql://` URLs (as pgserver and most tools print them)."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    raise ValueError("ABADA_DATABASE_URL must be a postgresql:// URL")


def plain_url(url: str) -> str:
    """The same URL for asyncpg itself (`postgresql://`)."""
    return async_url(url).replace("postgresql+asyncpg://", "postgresql://", 1)


# Every engine session: named, and ended by PostgreSQL if it ever sits in an open transaction doing
# nothing for a minute (the engine's transactions last milliseconds; one left open by a request cut
# off mid-way would otherwise hold its row and table locks, and every writer behind them, for good).
SESSION_SETTINGS = {"application_name": "abada-engine", "idle_in_transaction_session_timeout": "60000"}


def create_engine(url: str, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        # Waiting for a pooled connection is cheaper than opening one per burst: overflow connections
        # are closed again on return, and every new one pays a connect and re-prepares statements.
        max_overflow=0,
        pool_timeout=30,
        pool_pre_ping=False,
        json_serializer=dumps,
        # Statements are compiled once and cached by SQLAlchemy; asyncpg prepares them per connection.
        connect_args={"server_settings": SESSION_SETTINGS},
    )


def autocommit(engine: AsyncEngine) -> AsyncEngine:
    """The same pool without BEGIN/ROLLBACK round trips: for reads and single-statement writes."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")
