"""Volume: indexes that answer every list by keyset, and a queue autovacuum keeps lean."""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"

_OPEN_EXTERNAL = "kind = 'external' AND state IN ('READY', 'LEASED', 'INCIDENT', 'PARKED')"

# Each list reads its page from one index in its sort order, starting after the last row shown (see
# store/keyset.py): no list sorts or skips rows, so a page costs the same at any depth.
_INDEXES = (
    # Instances, newest first: all of them; the active ones (a small partial index: a finished
    # instance leaves it); the finished ones by state; one process's, with and without a state; a
    # business key's.
    ("instances_created_id", "instances (created_at, id)"),
    ("instances_active", "instances (created_at, id) WHERE state = 'ACTIVE'"),
    ("instances_ended", "instances (state, created_at, id) WHERE state <> 'ACTIVE'"),
    ("instances_process_created", "instances (process_id, created_at, id)"),
    ("instances_process_state_created", "instances (process_id, state, created_at, id)"),
    ("instances_business_key", "instances (business_key, created_at, id)"),
    # The queue's open external tasks, oldest first, all and by topic; user tasks waiting for a person.
    ("tasks_open_external", f"tasks (created_at, id) WHERE {_OPEN_EXTERNAL}"),
    ("tasks_open_external_topic", f"tasks (topic, created_at, id) WHERE {_OPEN_EXTERNAL}"),
    ("tasks_waiting_user", "tasks (created_at, id) WHERE kind = 'user' AND state = 'WAITING'"),
    # Incidents oldest first, by state and by state and type.
    ("incidents_state_created", "incidents (state, created_at, id)"),
    ("incidents_state_type_created", "incidents (state, type, created_at, id)"),
    # Approvals oldest first by state (a task's calls in their order).
    ("approvals_state_created_key", "approvals (state, created_at, task_id, sequence)"),
)

# The indexes these replace: the same leading columns without the key that makes each row's place unique.
_REPLACED = (
    ("instances_created", "instances (created_at)"),
    ("instances_process_state", "instances (process_id, state, created_at)"),
    ("incidents_state_type", "incidents (state, type)"),
    ("approvals_state_created", "approvals (state, created_at)"),
)

# Autovacuum by default waits for a fifth of a table to be dead: 200k rows at a million tasks, 2M at
# ten million, while every dead entry in the queue's partial index costs each fetch a buffer read. The
# hot tables are vacuumed after a fixed number of changes instead, at full speed (their live part is
# small; a vacuum of it is quick), and analyzed as often so plans follow the queue's real shape.
_HOT_TABLES = {
    "tasks": 2000,
    "model_quota_usage": 1000,
    "model_quota_calls": 1000,
    "model_quota_waiters": 1000,
    "dependencies": 200,
}
# Instances and journal steps are written once and changed a few times: a smaller share than the default.
_WARM_TABLES = {"instances": 0.02, "journal_steps": 0.05, "approvals": 0.05, "incidents": 0.05}


# Every statement is composed here from the constants above, before any function runs.
_UPGRADE = [
    *(f"CREATE INDEX {name} ON {definition}" for name, definition in _INDEXES),
    *(f"DROP INDEX {name}" for name, _ in _REPLACED),
    *(
        f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = 0, "
        f"autovacuum_vacuum_threshold = {threshold}, "
        f"autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = {threshold}, "
        f"autovacuum_analyze_scale_factor = 0, autovacuum_analyze_threshold = {threshold}, "
        "autovacuum_vacuum_cost_delay = 0)"
        for table, threshold in _HOT_TABLES.items()
    ),
    *(
        f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = {share}, "
        f"autovacuum_analyze_scale_factor = {share})"
        for table, share in _WARM_TABLES.items()
    ),
]
_DOWNGRADE = [
    *(
        f"ALTER TABLE {table} RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold, "
        "autovacuum_vacuum_insert_scale_factor, autovacuum_vacuum_insert_threshold, "
        "autovacuum_analyze_scale_factor, autovacuum_analyze_threshold, autovacuum_vacuum_cost_delay)"
        for table in (*_HOT_TABLES, *_WARM_TABLES)
    ),
    *(f"CREATE INDEX {name} ON {definition}" for name, definition in _REPLACED),
    *(f"DROP INDEX {name}" for name, _ in _INDEXES),
]


def upgrade() -> None:
    for statement in _UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    for statement in _DOWNGRADE:
        op.execute(statement)
