"""Alembic environment: runs on the connection the engine hands in (see `abada_engine.db.migrate`)."""

from __future__ import annotations

from alembic import context

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=None, transaction_per_migration=False)
with context.begin_transaction():
    context.run_migrations()
