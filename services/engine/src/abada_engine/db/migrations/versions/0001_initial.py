"""Initial schema: definitions, instances, tasks, history, incidents, journal."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "definitions",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("process_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("content_sha256", sa.Text, nullable=False),
        sa.Column("source_name", sa.Text, nullable=False),
        sa.Column("spec", JSONB, nullable=False),
        sa.Column("tool_bindings", JSONB, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.UniqueConstraint("process_id", "version", name="definitions_process_version_key"),
    )
    op.create_table(
        "instances",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("definition_id", sa.Uuid, sa.ForeignKey("definitions.id"), nullable=False),
        sa.Column("process_id", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("variables", JSONB, nullable=False),
        sa.Column("current_node_id", sa.Text),
        sa.Column("business_key", sa.Text, nullable=False, server_default=""),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("ended_at", TS),
    )
    op.create_index("instances_process_state", "instances", ["process_id", "state", "created_at"])
    op.create_index("instances_created", "instances", ["created_at"])
    op.create_table(
        "tasks",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("instance_id", sa.Uuid, sa.ForeignKey("instances.id"), nullable=False),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("topic", sa.Text),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("payload", JSONB, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="0"),
        sa.Column("retries_left", sa.Integer, nullable=False),
        sa.Column("due_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_token_hash", sa.LargeBinary),
        sa.Column("lease_expires_at", TS),
        sa.Column("last_error", JSONB),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("completed_at", TS),
    )
    # The queue: a READY task is fetchable once due (backoff), a LEASED one once its lease expired.
    op.execute("CREATE INDEX tasks_fetchable ON tasks (topic, due_at) WHERE state IN ('READY', 'LEASED')")
    op.create_index("tasks_instance", "tasks", ["instance_id"])
    op.create_table(
        "history",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("instance_id", sa.Uuid, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("node_id", sa.Text),
        sa.Column("task_id", sa.Uuid),
        sa.Column("data", JSONB, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
    )
    op.create_index("history_instance", "history", ["instance_id", "id"])
    op.create_table(
        "incidents",
        sa.Column("id", sa.Uuid, primary_key=True),
        sa.Column("instance_id", sa.Uuid, sa.ForeignKey("instances.id"), nullable=False),
        sa.Column("task_id", sa.Uuid),
        sa.Column("node_id", sa.Text, nullable=False),
        sa.Column("type", sa.Text, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("details", JSONB, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("resolved_at", TS),
        sa.Column("resolution", sa.Text),
    )
    op.create_index("incidents_state_type", "incidents", ["state", "type"])
    op.create_index("incidents_instance", "incidents", ["instance_id"])
    op.create_table(
        "journal_steps",
        sa.Column("task_id", sa.Uuid, sa.ForeignKey("tasks.id"), primary_key=True),
        sa.Column("sequence", sa.Integer, primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("tool_ref", sa.Text, nullable=False, server_default=""),
        sa.Column("key_id", sa.Text, nullable=False),
        sa.Column("request_ciphertext", sa.LargeBinary),
        sa.Column("response_ciphertext", sa.LargeBinary),
        sa.Column("request_digest", sa.LargeBinary),
        sa.Column("response_digest", sa.LargeBinary),
        sa.Column("input_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("output_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("abandoned", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
    )


def downgrade() -> None:
    for table in ("journal_steps", "incidents", "history", "tasks", "instances", "definitions"):
        op.drop_table(table)
