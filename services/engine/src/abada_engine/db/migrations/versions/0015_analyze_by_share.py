"""Hot tables are analyzed after a share of their rows changes, not after a fixed count.

Migration 0008 had autovacuum analyze `tasks` and the quota ledger after the same fixed number of
changes it vacuums them after. A vacuum's cost follows the dead rows it clears; an ANALYZE's follows
the table: it samples 30,000 rows, so at a million finished tasks it reads the whole table (about
150 MB, half a second of a core) every 2,000 changes, a few seconds of a busy queue. Analyzing after
the same count plus a tenth of the rows (PostgreSQL's own default share) keeps the statistics as
fresh for a small queue and stops a large history from paying a full read every few seconds.
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"

# The tables 0008 made hot; their analyze threshold (the fixed count) stays as 0008 set it.
_HOT_TABLES = ("tasks", "model_quota_usage", "model_quota_calls", "model_quota_waiters", "dependencies")
_ANALYZE_SHARE = 0.1

# Every statement is composed here from the constants above, before any function runs.
_UPGRADE = [
    f"ALTER TABLE {table} SET (autovacuum_analyze_scale_factor = {_ANALYZE_SHARE})" for table in _HOT_TABLES
]
_DOWNGRADE = [f"ALTER TABLE {table} SET (autovacuum_analyze_scale_factor = 0)" for table in _HOT_TABLES]


def upgrade() -> None:
    for statement in _UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    for statement in _DOWNGRADE:
        op.execute(statement)
