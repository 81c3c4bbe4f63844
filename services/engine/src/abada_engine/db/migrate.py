"""Apply the Alembic migrations, safely even when several engine replicas start at once."""

from __future__ import annotations

import logging
import pathlib

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS = pathlib.Path(__file__).parent / "migrations"
# Any constant works; replicas only need to agree on it.
_MIGRATION_LOCK = 0x0ABADA

log = logging.getLogger(__name__)


def _upgrade(connection: Connection) -> tuple[str | None, str | None]:
    """Upgrades to head; returns the schema revision before and after."""
    connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
    before = MigrationContext.configure(connection).get_current_revision()
    config = Config(str(MIGRATIONS / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = connection
    command.upgrade(config, "head")
    return before, MigrationContext.configure(connection).get_current_revision()


async def migrate(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        before, after = await connection.run_sync(_upgrade)
    # Alembic's own INFO lines are kept quiet (abada_common.log_noise): this one says what changed.
    if before != after:
        log.info("database schema upgraded", extra={"from_revision": before, "to_revision": after})
