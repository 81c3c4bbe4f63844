"""Approvals: a tool call under `approval: required` waits here for a person's decision."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "approvals",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("task_id", sa.Uuid, sa.ForeignKey("tasks.id"), nullable=False),
        # The journal step of the proposed call; its sealed request holds the arguments.
        sa.Column("sequence", sa.Integer, nullable=False),
        sa.Column("instance_id", sa.Uuid, sa.ForeignKey("instances.id"), nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("tool_ref", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("expires_at", TS),
        sa.Column("decided_by", sa.Text),
        sa.Column("decided_at", TS),
        sa.Column("comment", sa.Text),
        # A keyed digest of the request the approved call must carry (under key `key_id`), so the
        # journal recognises the approved call without keeping its arguments in clear.
        sa.Column("key_id", sa.Text),
        sa.Column("approved_request_digest", sa.LargeBinary),
        sa.UniqueConstraint("task_id", "sequence", name="approvals_task_sequence_key"),
    )
    op.create_index("approvals_state_created", "approvals", ["state", "created_at"])
    op.create_index("approvals_instance", "approvals", ["instance_id"])
    # The reaper's question: which pending approvals ran out.
    op.execute("CREATE INDEX approvals_pending_expiry ON approvals (expires_at) WHERE state = 'PENDING'")


def downgrade() -> None:
    op.drop_table("approvals")
