"""Apply the Alembic migrations, safely even when several engine replicas start at once."""

from __future__ import annotations

import pathlib

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = pathlib.Path(__file__).parent / "migrations"
# Any constant works; replicas only need to agree on it.
_MIGRATION_LOCK = 0x0ABADA


def _upgrade(connection: Connection) -> None:
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


async def migrate(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(_upgrade)
