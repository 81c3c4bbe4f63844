"""Call activities: an instance started by another one's `call` node knows its parent and the call's task."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"


def upgrade() -> None:
    # No foreign keys: retention deletes a parent and its children each on its own retention.
    op.add_column("instances", sa.Column("parent_instance_id", sa.Uuid))
    # The parent's `call` task the child answers to when it ends.
    op.add_column("instances", sa.Column("parent_task_id", sa.Uuid))
    # A parent's children (GetInstance, ListInstances by parent, cancelling a subtree): only called
    # instances are in it.
    op.execute(
        "CREATE INDEX instances_children ON instances (parent_instance_id, created_at) "
        "WHERE parent_instance_id IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("instances_children", table_name="instances")
    op.drop_column("instances", "parent_task_id")
    op.drop_column("instances", "parent_instance_id")
