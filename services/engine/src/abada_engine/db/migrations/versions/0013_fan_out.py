"""Multi-instance (`for_each`): a fan-out per running node, its items as tasks with an index and a result."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0013"
down_revision = "0012"

# A fan-out's open items, in index order: where an item's end finds the next PENDING one and where
# the last ends count what is still open, without reading the items already ended. The open task
# states are store/states.py's OPEN_TASK_STATES, as this revision knew them.
_OPEN_ITEMS_INDEX = (
    "CREATE INDEX tasks_fan_out_open ON tasks (fan_out_id, item_index) WHERE fan_out_id IS NOT NULL "
    "AND state IN ('READY', 'LEASED', 'WAITING', 'INCIDENT', 'AWAITING_APPROVAL', 'PARKED', 'PENDING')"
)


def upgrade() -> None:
    op.create_table(
        "fan_outs",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("instance_id", sa.Uuid, sa.ForeignKey("instances.id"), nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        # How many items, and how many may be open at once (each item's end offers the next PENDING one).
        sa.Column("total", sa.Integer, nullable=False),
        sa.Column("max_concurrency", sa.Integer, nullable=False),
        # RUNNING, COMPLETED or CANCELED.
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True)),
    )
    op.create_index("fan_outs_instance", "fan_outs", ["instance_id"])
    # The running ones: where the duty looking for an undecided end reads.
    op.execute("CREATE INDEX fan_outs_running ON fan_outs (id) WHERE state = 'RUNNING'")
    # No foreign key: an item is found through its fan-out's id and index, never the other way round.
    op.add_column("tasks", sa.Column("fan_out_id", sa.Uuid))
    op.add_column("tasks", sa.Column("item_index", sa.Integer))
    # What the item's completion gave for the node's result_variable (null when skipped).
    op.add_column("tasks", sa.Column("item_result", JSONB))
    op.execute(
        "CREATE UNIQUE INDEX tasks_fan_out_items ON tasks (fan_out_id, item_index) WHERE fan_out_id IS NOT NULL"
    )
    op.execute(_OPEN_ITEMS_INDEX)


def downgrade() -> None:
    op.drop_index("tasks_fan_out_open", table_name="tasks")
    op.drop_index("tasks_fan_out_items", table_name="tasks")
    op.drop_column("tasks", "item_result")
    op.drop_column("tasks", "item_index")
    op.drop_column("tasks", "fan_out_id")
    op.drop_index("fan_outs_running", table_name="fan_outs")
    op.drop_table("fan_outs")
