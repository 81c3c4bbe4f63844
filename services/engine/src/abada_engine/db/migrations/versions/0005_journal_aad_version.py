"""Journal steps record the associated data version their payloads were sealed with."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    # Every row written before this revision was sealed with version 1 (task, sequence and field);
    # the engine writes 2 from now on, and `abada-engine reseal` moves old rows over.
    op.add_column(
        "journal_steps", sa.Column("aad_version", sa.SmallInteger, nullable=False, server_default="1")
    )


def downgrade() -> None:
    op.drop_column("journal_steps", "aad_version")
