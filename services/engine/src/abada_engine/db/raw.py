"""Hot-path statements straight through the asyncpg driver of a SQLAlchemy connection.

SQLAlchemy's execution layer costs about as much CPU per statement as the round trip itself;
for the few statements every task cycle and journal step runs, the engine sends them through
the driver of the same pooled connection (and so inside the same transaction, if any).
Statements keep SQLAlchemy's `:name` parameter style and are translated once to `$n`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

_PARAMETER = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class Row(dict[str, Any]):
    """A result row readable as `row.column`, like SQLAlchemy's rows."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class RawSql:
    def __init__(self, sql: str) -> None:
        self.names: list[str] = []

        def number(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in self.names:
                self.names.append(name)
            return f"${self.names.index(name) + 1}"

        self.sql = _PARAMETER.sub(number, sql)

    def _args(self, params: Mapping[str, Any]) -> list[Any]:
        return [params[name] for name in self.names]

    async def fetch(self, conn: AsyncConnection, params: Mapping[str, Any]) -> list[Row]:
        driver = (await conn.get_raw_connection()).driver_connection
        return [Row(record) for record in await driver.fetch(self.sql, *self._args(params))]

    async def fetchrow(self, conn: AsyncConnection, params: Mapping[str, Any]) -> Row | None:
        driver = (await conn.get_raw_connection()).driver_connection
        record = await driver.fetchrow(self.sql, *self._args(params))
        return Row(record) if record is not None else None
