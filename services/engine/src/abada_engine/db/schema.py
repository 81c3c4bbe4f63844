"""Table definitions for queries; the migrations under `migrations/` create them."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Table,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

definitions = Table(
    "definitions",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("process_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("content_sha256", Text, nullable=False),
    Column("source_name", Text, nullable=False),
    Column("spec", JSONB, nullable=False),
    Column("tool_bindings", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    # How long the version keeps finished instances; NULL for versions deployed before retention (0011).
    Column("retention_seconds", Float),
)

instances = Table(
    "instances",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("definition_id", Uuid, ForeignKey("definitions.id"), nullable=False),
    Column("process_id", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("variables", JSONB, nullable=False),
    Column("current_node_id", Text),
    Column("business_key", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True)),
    # Set on an instance a call activity started: its parent and the parent's `call` task (0014).
    Column("parent_instance_id", Uuid),
    Column("parent_task_id", Uuid),
)

# A start's request_id, so the same start sent again within a day answers the first instance (0009).
start_requests = Table(
    "start_requests",
    metadata,
    Column("request_id", Text, primary_key=True),
    Column("instance_id", Uuid, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("instance_id", Uuid, ForeignKey("instances.id"), nullable=False),
    Column("node_id", Text, nullable=False),
    Column("kind", Text, nullable=False),  # external | user
    Column("topic", Text),
    Column("state", Text, nullable=False),
    Column("payload", JSONB, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("retries_left", Integer, nullable=False),
    Column("due_at", DateTime(timezone=True), nullable=False),
    Column("lease_owner", Text),
    Column("lease_token_hash", LargeBinary),
    Column("lease_expires_at", DateTime(timezone=True)),
    Column("last_error", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("completed_at", DateTime(timezone=True)),
    # Waiting out a dependency's outage (migration 0006).
    Column("parked_on", Text),
    Column("waiting_since", DateTime(timezone=True)),
    Column("outage_deadline", DateTime(timezone=True)),
    Column("outage_waits", Integer, nullable=False),
    # An item of a `for_each` (migration 0013): its fan-out, its place in the list and what it gave.
    Column("fan_out_id", Uuid),
    Column("item_index", Integer),
    Column("item_result", JSONB),
)

# A `for_each` node running (or ran) in an instance: its items are tasks (migration 0013).
fan_outs = Table(
    "fan_outs",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("instance_id", Uuid, ForeignKey("instances.id"), nullable=False),
    Column("node_id", Text, nullable=False),
    Column("total", Integer, nullable=False),
    Column("max_concurrency", Integer, nullable=False),
    Column("state", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True)),
)

dependencies = Table(
    "dependencies",
    metadata,
    Column("key", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("name", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("down_since", DateTime(timezone=True)),
    Column("failed_probes", Integer, nullable=False),
    Column("last_error", Text, nullable=False),
    Column("next_probe_at", DateTime(timezone=True)),
    Column("probe_task_id", Uuid),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

history = Table(
    "history",
    metadata,
    # The primary key is (instance_id, id), in that order (migration 0016): every read and deletion
    # of the history goes by instance.
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("instance_id", Uuid, primary_key=True),
    Column("type", Text, nullable=False),
    Column("node_id", Text),
    Column("task_id", Uuid),
    Column("data", JSONB, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

incidents = Table(
    "incidents",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("instance_id", Uuid, ForeignKey("instances.id"), nullable=False),
    Column("task_id", Uuid),
    Column("node_id", Text, nullable=False),
    Column("type", Text, nullable=False),
    Column("message", Text, nullable=False),
    Column("details", JSONB, nullable=False),
    Column("state", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("resolved_at", DateTime(timezone=True)),
    Column("resolution", Text),
)

journal_steps = Table(
    "journal_steps",
    metadata,
    Column("task_id", Uuid, primary_key=True),
    Column("sequence", Integer, primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("kind", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("tool_ref", Text, nullable=False),
    Column("key_id", Text, nullable=False),
    # The associated data version the payloads were sealed with (runtime/crypto/sealing.py).
    Column("aad_version", SmallInteger, nullable=False),
    Column("request_ciphertext", LargeBinary),
    Column("response_ciphertext", LargeBinary),
    # Keyed digests of the plaintexts, so an identical re-send is recognised without decrypting.
    Column("request_digest", LargeBinary),
    Column("response_digest", LargeBinary),
    Column("input_tokens", BigInteger, nullable=False),
    Column("output_tokens", BigInteger, nullable=False),
    Column("abandoned", Boolean, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

model_quota_usage = Table(
    "model_quota_usage",
    metadata,
    Column("model", Text, primary_key=True),
    Column("second", BigInteger, primary_key=True),
    # 0: admissions' counts, written under the model's lock; 1-8: settlements' and releases'
    # corrections (negative at times), so they never wait on the row admissions hold (migration 0004).
    Column("slot", SmallInteger, primary_key=True),
    Column("requests", Integer, nullable=False),
    Column("tokens", BigInteger, nullable=False),
)

model_quota_calls = Table(
    "model_quota_calls",
    metadata,
    Column("task_id", Uuid, primary_key=True),
    Column("sequence", Integer, primary_key=True),
    Column("attempt", Integer, nullable=False),
    Column("model", Text, nullable=False),
    Column("second", BigInteger, nullable=False),
    Column("estimated_tokens", BigInteger, nullable=False),
    Column("admitted_at", DateTime(timezone=True), nullable=False),
)

model_quota_waiters = Table(
    "model_quota_waiters",
    metadata,
    Column("task_id", Uuid, primary_key=True),
    Column("sequence", Integer, primary_key=True),
    Column("model", Text, nullable=False),
    Column("ticket", BigInteger, nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Column("arrived_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
)

approvals = Table(
    "approvals",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("task_id", Uuid, ForeignKey("tasks.id"), nullable=False),
    Column("sequence", Integer, nullable=False),
    Column("instance_id", Uuid, ForeignKey("instances.id"), nullable=False),
    Column("node_id", Text, nullable=False),
    Column("tool_ref", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True)),
    Column("decided_by", Text),
    Column("decided_at", DateTime(timezone=True)),
    Column("comment", Text),
    Column("key_id", Text),
    Column("approved_request_digest", LargeBinary),
)

timers = Table(
    "timers",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("instance_id", Uuid, ForeignKey("instances.id"), nullable=False),
    Column("task_id", Uuid, ForeignKey("tasks.id"), nullable=False),
    Column("node_id", Text, nullable=False),
    Column("kind", Text, nullable=False),  # store.states.TimerKind
    Column("due_at", DateTime(timezone=True), nullable=False),
    Column("fired_at", DateTime(timezone=True)),
)

messages = Table(
    "messages",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("name", Text, nullable=False),
    Column("correlation_key", Text, nullable=False),
    Column("variables", JSONB, nullable=False),
    Column("message_id", Text),
    Column("published_by", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("correlated_instance_id", Uuid),
    Column("correlated_at", DateTime(timezone=True)),
)

# One row per erasure (migration 0011): who, when, how many rows went; never whose they were.
erasures = Table(
    "erasures",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("erased_by", Text, nullable=False),
    Column("erased_at", DateTime(timezone=True), nullable=False),
    Column("selected_by", Text, nullable=False),
    Column("instances", Integer, nullable=False),
    Column("canceled", Integer, nullable=False),
    Column("rows", BigInteger, nullable=False),
)

# Batch operations (migration 0012): one operation over the instances a filter matched.
batches = Table(
    "batches",
    metadata,
    Column("id", Uuid, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("filter", JSONB, nullable=False),
    Column("parameters", JSONB, nullable=False),
    Column("created_by", Text, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("ended_at", DateTime(timezone=True)),
    Column("total", Integer, nullable=False),
    Column("done", Integer, nullable=False),
    Column("skipped", Integer, nullable=False),
    Column("failed", Integer, nullable=False),
)

batch_items = Table(
    "batch_items",
    metadata,
    Column("batch_id", Uuid, ForeignKey("batches.id"), primary_key=True),
    Column("instance_id", Uuid, primary_key=True),
    Column("outcome", Text, nullable=False),
    Column("message", Text, nullable=False),
    Column("finished_at", DateTime(timezone=True)),
)
