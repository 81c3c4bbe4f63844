"""Letting old data go: the indexes retention, purge and erasure delete through, and the erasure audit."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"

# Each index lets a delete (or the foreign-key check a delete triggers) find an instance's or a task's
# rows by an index probe instead of a scan of the whole table.
_INDEXES = (
    # Finished instances of one version, oldest end first: the retention job and purge read these.
    ("instances_finished_ended", "instances (definition_id, ended_at) WHERE state <> 'ACTIVE'"),
    ("start_requests_instance", "start_requests (instance_id)"),
    ("timers_instance", "timers (instance_id)"),
    ("approvals_task", "approvals (task_id)"),
    ("messages_correlated", "messages (correlated_instance_id) WHERE correlated_instance_id IS NOT NULL"),
)

# Every statement is composed here from the constants above, before any function runs.
_CREATE_INDEXES = [f"CREATE INDEX {name} ON {definition}" for name, definition in _INDEXES]
_DROP_INDEXES = [f"DROP INDEX {name}" for name, _ in reversed(_INDEXES)]


def upgrade() -> None:
    for statement in _CREATE_INDEXES:
        op.execute(statement)
    # How long each version keeps its finished instances, written at deploy. The versions deployed
    # before retention existed have none (NULL): the job never deletes their instances, so an upgrade
    # deletes nothing by itself; an operator purges them (`abada purge`) when they choose.
    op.add_column("definitions", sa.Column("retention_seconds", sa.Float, nullable=True))
    # One row per erasure: who asked, when, how much went. Nothing that names the customer.
    op.create_table(
        "erasures",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("erased_by", sa.Text, nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=False),
        # What selected the instances: "business_key" or "variables" (the kind, never the value).
        sa.Column("selected_by", sa.Text, nullable=False),
        sa.Column("instances", sa.Integer, nullable=False),
        sa.Column("canceled", sa.Integer, nullable=False),
        sa.Column("rows", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_column("definitions", "retention_seconds")
    op.drop_table("erasures")
    for statement in _DROP_INDEXES:
        op.execute(statement)
