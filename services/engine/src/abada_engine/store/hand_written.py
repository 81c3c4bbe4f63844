"""Hand-written statements sent straight through the asyncpg driver of a SQLAlchemy connection.

The store writes its statements with SQLAlchemy Core. The few every task cycle and journal step
runs are hand-written instead: SQLAlchemy's execution layer costs about as much CPU per statement
as the round trip itself, and several of them are single-statement CTEs (lock and lease, check and
insert, finish and move the token) that Core would only obscure. They go through the driver of the
same pooled connection, so inside the same transaction, if any. They keep SQLAlchemy's `:name`
parameter style, translated once to asyncpg's `$n`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncConnection

_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")

R = TypeVar("R")


class Row(dict[str, Any]):
    """A result row readable as `row.column`, like SQLAlchemy's rows."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HandWritten:
    """One hand-written statement; see the module docstring for why these exist."""

    def __init__(self, sql: str) -> None:
        self.names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.names:
                self.names.append(name)
            return f"${self.names.index(name) + 1}"

        self.sql = _PARAMETER.sub(number, sql)

    def args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]

    async def fetch(self, conn: AsyncConnection, params: Mapping[str, Any]) -> list[Row]:
        driver = (await conn.get_raw_connection()).driver_connection
        return [Row(record) for record in await driver.fetch(self.sql, *self.args(params))]

    async def fetchrow(self, conn: AsyncConnection, params: Mapping[str, Any]) -> Row | None:
        driver = (await conn.get_raw_connection()).driver_connection
        record = await driver.fetchrow(self.sql, *self.args(params))
        return Row(record) if record is not None else None


def typed(cls: type[R], record: Mapping[str, Any]) -> R:
    """A typed row from a result row: the dataclass's fields, taken by name."""
    return cls(**{name: record[name] for name in _field_names(cls)})


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names
