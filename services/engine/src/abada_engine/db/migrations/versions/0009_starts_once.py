"""Starts that happen once (a start's request id, remembered for a day), and instances found by a
variable's value.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    op.create_table(
        "start_requests",
        sa.Column("request_id", sa.Text, primary_key=True),
        sa.Column("instance_id", sa.Uuid, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    # Queue upkeep lets the day-old ones go, oldest first.
    op.create_index("start_requests_created", "start_requests", ["created_at"])
    # ListInstances(variables=[customerId = "C-42"]) is a containment (`variables @> ...`); jsonb_path_ops
    # indexes each path-and-value pair once: smaller and quicker to update than the default GIN class.
    op.execute("CREATE INDEX instances_variables ON instances USING gin (variables jsonb_path_ops)")


def downgrade() -> None:
    op.execute("DROP INDEX instances_variables")
    op.drop_table("start_requests")
