"""Waiting on the world: due times (timers, receive timeouts, deadlines) and published messages."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    # One row per due time a task was created with. Replicas claim the due ones oldest first through
    # the partial index (a fired row leaves it), so a firing round reads only what is due.
    op.create_table(
        "timers",
        sa.Column("id", sa.BigInteger, primary_key=True, autoincrement=True),
        sa.Column("instance_id", sa.Uuid, sa.ForeignKey("instances.id"), nullable=False),
        sa.Column("task_id", sa.Uuid, sa.ForeignKey("tasks.id"), nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("fired_at", sa.DateTime(timezone=True)),
    )
    op.execute("CREATE INDEX timers_due ON timers (due_at) WHERE fired_at IS NULL")
    # A fired row leaves a dead entry at the head of `timers_due`, where every claim starts reading:
    # vacuum after a fixed number of changes (as for the queue's hot tables in 0008), not a fifth of
    # the table, so a minute of 100,000 firings does not leave claims reading past them.
    op.execute(
        "ALTER TABLE timers SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 2000, "
        "autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 2000, "
        "autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = 2000, "
        "autovacuum_vacuum_cost_delay = 0)"
    )
    op.execute("CREATE INDEX timers_task ON timers (task_id)")
    # Published messages: buffered until correlated or their ttl passes, and kept until then for
    # message_id's idempotency either way.
    op.create_table(
        "messages",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("correlation_key", sa.Text, nullable=False),
        sa.Column("variables", JSONB, nullable=False),
        sa.Column("message_id", sa.Text),
        sa.Column("published_by", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("correlated_instance_id", sa.Uuid),
        sa.Column("correlated_at", sa.DateTime(timezone=True)),
    )
    op.execute(
        "CREATE INDEX messages_buffered ON messages (name, correlation_key, created_at) "
        "WHERE correlated_at IS NULL"
    )
    op.execute("CREATE INDEX messages_message_id ON messages (name, message_id) WHERE message_id IS NOT NULL")
    op.execute("CREATE INDEX messages_expires ON messages (expires_at)")
    # The receives waiting for a message, by name and key, oldest first: the one a message goes to.
    op.execute(
        "CREATE INDEX tasks_waiting_receive ON tasks ((payload ->> 'message'), (payload ->> 'correlation_key'), "
        "created_at) WHERE kind = 'receive' AND state = 'WAITING'"
    )
    # What `instances --waiting-for` reads: the open waits of each kind.
    op.execute("CREATE INDEX tasks_waiting_world ON tasks (kind, instance_id) WHERE state = 'WAITING'")


def downgrade() -> None:
    op.execute("DROP INDEX tasks_waiting_world")
    op.execute("DROP INDEX tasks_waiting_receive")
    op.drop_table("messages")
    op.drop_table("timers")
