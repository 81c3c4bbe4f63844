"""Dependencies' circuits, and tasks parked while one is down."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    # One row per dependency a worker ever reported on (`model:gemini-3.6-flash`, `tool_server:crm`,
    # `broker:broker`, `secret_store:secret-store`): its circuit, shared by every replica.
    op.create_table(
        "dependencies",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("down_since", sa.DateTime(timezone=True)),
        sa.Column("failed_probes", sa.Integer, nullable=False, server_default="0"),
        sa.Column("last_error", sa.Text, nullable=False, server_default=""),
        sa.Column("next_probe_at", sa.DateTime(timezone=True)),
        sa.Column("probe_task_id", UUID(as_uuid=True)),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.execute("CREATE INDEX dependencies_due_probes ON dependencies (next_probe_at) WHERE state = 'DOWN'")
    # A parked task waits for `parked_on` to answer; `waiting_since` is when it first met the outage it
    # waits out (its node's outage_budget counts from there), `outage_deadline` when that budget ends,
    # `outage_waits` how many temporary failures in a row it has reported (its backoff's exponent).
    op.add_column("tasks", sa.Column("parked_on", sa.Text))
    op.add_column("tasks", sa.Column("waiting_since", sa.DateTime(timezone=True)))
    op.add_column("tasks", sa.Column("outage_deadline", sa.DateTime(timezone=True)))
    op.add_column("tasks", sa.Column("outage_waits", sa.Integer, nullable=False, server_default="0"))
    op.execute("CREATE INDEX tasks_parked ON tasks (parked_on, created_at) WHERE state = 'PARKED'")
    op.execute("CREATE INDEX tasks_parked_deadline ON tasks (outage_deadline) WHERE state = 'PARKED'")


def downgrade() -> None:
    op.execute("DROP INDEX tasks_parked_deadline")
    op.execute("DROP INDEX tasks_parked")
    for column in ("outage_waits", "outage_deadline", "waiting_since", "parked_on"):
        op.drop_column("tasks", column)
    op.drop_table("dependencies")
