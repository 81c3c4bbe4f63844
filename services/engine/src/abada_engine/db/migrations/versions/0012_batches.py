"""Batch operations: a batch (one operation over the instances a filter matched) and each instance's outcome."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Uuid, primary_key=True),
        # What is done to each instance: RETRY_INCIDENTS or CANCEL (more kinds add a value, not a table).
        sa.Column("kind", sa.Text, nullable=False),
        # RUNNING, PAUSED, COMPLETED or CANCELED.
        sa.Column("state", sa.Text, nullable=False),
        # The filter as the operator gave it, kept to show it back.
        sa.Column("filter", JSONB, nullable=False),
        # The kind's own parameters (CANCEL's reason).
        sa.Column("parameters", JSONB, nullable=False),
        sa.Column("created_by", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("done", sa.Integer, nullable=False, server_default="0"),
        sa.Column("skipped", sa.Integer, nullable=False, server_default="0"),
        sa.Column("failed", sa.Integer, nullable=False, server_default="0"),
    )
    op.create_index("batches_created", "batches", ["created_at"])
    # One row per instance the filter matched; no foreign key: the outcome outlives a purged instance.
    op.create_table(
        "batch_items",
        sa.Column("batch_id", sa.Uuid, sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
        sa.Column("instance_id", sa.Uuid, nullable=False),
        # PENDING, DONE, SKIPPED or FAILED.
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("message", sa.Text, nullable=False, server_default=""),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.PrimaryKeyConstraint("batch_id", "instance_id"),
    )
    # The job claims from here: only the items still to do, whatever the size of finished batches.
    op.execute(
        "CREATE INDEX batch_items_pending ON batch_items (batch_id, instance_id) WHERE outcome = 'PENDING'"
    )


def downgrade() -> None:
    op.drop_table("batch_items")
    op.drop_table("batches")
