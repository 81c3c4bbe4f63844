"""Whether the configured PostgreSQL answers at start, said as one line a person can act on."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

# asyncpg's own exceptions, by class name: the ones a wrong ABADA_DATABASE_URL meets first.
_REASONS = {
    "InvalidCatalogNameError": "the database does not exist",
    "InvalidPasswordError": "the password was refused",
    "InvalidAuthorizationSpecificationError": "the user was refused",
}


class DatabaseUnreachable(Exception):
    """The database cannot be used; the message names the setting, where it points and why."""


def mask_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _where(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or "localhost"
    return f"{host}:{port or 5432}"


def _cause(error: BaseException) -> BaseException:
    """The error under SQLAlchemy's wrappers: asyncpg's own, or the socket's."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) or type(current).__module__.startswith("asyncpg"):
            return current
        current = getattr(current, "orig", None) or current.__cause__ or current.__context__
    return error


def _reason(error: BaseException) -> str:
    cause = _cause(error)
    name = type(cause).__name__
    if name in _REASONS:
        return f"{_REASONS[name]} ({str(cause).strip()})"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused (is PostgreSQL running there, on that port?)"
    if isinstance(cause, TimeoutError):
        return "no answer in time"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(cause).strip().splitlines()[0] if str(cause).strip() else name


async def require_database(db: AsyncEngine, url: str, setting: str = "ABADA_DATABASE_URL") -> None:
    """One round trip before anything else touches the database; DatabaseUnreachable when it fails."""
    try:
        async with db.connect() as connection:
            await connection.execute(text("SELECT 1"))
    except Exception as error:
        raise DatabaseUnreachable(
            f"cannot use the database at {setting}={mask_password(url)} (host {_where(url)}): {_reason(error)}"
        ) from None
