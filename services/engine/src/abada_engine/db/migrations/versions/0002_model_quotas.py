"""Model quotas shared by every replica: usage per model and second, admitted calls, the waiting line."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"

TS = sa.DateTime(timezone=True)

# Admission is one call of this function, so one round trip, in its own short transaction. It takes a
# per-model advisory lock first; PL/pgSQL gives every statement after it a fresh snapshot, so the usage
# it reads includes every admission committed before the lock was granted (a single SQL statement
# would read a snapshot taken before waiting for the lock, and two replicas could both admit the last
# free call). The waiting line keeps arrival order per model: a call is admitted only when what is
# left of the window also covers every live waiter that arrived before it, so no later call passes a
# waiting one.
ADMIT_FUNCTION = """
CREATE FUNCTION abada_admit_model_call(
    p_model text, p_task uuid, p_sequence integer, p_attempt integer,
    p_requests_per_minute integer, p_tokens_per_minute bigint, p_max_concurrent integer,
    p_tokens bigint, p_span_seconds integer
) RETURNS TABLE (admitted boolean, retry_after_ms bigint, reason text, waiting_ahead integer)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_ms bigint;
    now_s bigint;
    used_requests bigint;
    used_tokens bigint;
    in_flight integer;
    my_ticket bigint;
    ahead integer;
    ahead_tokens bigint;
    why text := '';
    need bigint;
    freed_at bigint;
    wait_ms bigint;
BEGIN
    -- The lock is held until the commit; waiting there for the WAL flush would make every admission
    -- of a model wait for the previous one's disk write. A crash of PostgreSQL itself may forget the
    -- last few milliseconds of admissions: the windows then undercount by those calls, once.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended('abada.model_quota:' || p_model, 0));
    IF EXISTS (SELECT 1 FROM model_quota_calls c WHERE c.task_id = p_task AND c.sequence = p_sequence) THEN
        -- The same STARTED again (a retried request): admitted once, counted once.
        RETURN QUERY SELECT true, 0::bigint, ''::text, 0;
        RETURN;
    END IF;
    now_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    now_s := now_ms / 1000;
    SELECT COALESCE(sum(u.requests), 0), COALESCE(sum(u.tokens), 0) INTO used_requests, used_tokens
    FROM model_quota_usage u WHERE u.model = p_model AND u.second > now_s - p_span_seconds;
    in_flight := 0;
    IF p_max_concurrent IS NOT NULL THEN
        SELECT count(*) INTO in_flight
        FROM model_quota_calls c JOIN tasks t ON t.id = c.task_id
        WHERE c.model = p_model AND t.state = 'LEASED' AND t.attempt = c.attempt
          AND t.lease_expires_at > clock_timestamp();
    END IF;
    SELECT w.ticket INTO my_ticket FROM model_quota_waiters w
    WHERE w.task_id = p_task AND w.sequence = p_sequence;
    SELECT count(*), COALESCE(sum(w.tokens), 0) INTO ahead, ahead_tokens FROM model_quota_waiters w
    WHERE w.model = p_model AND w.expires_at > clock_timestamp()
      AND (my_ticket IS NULL OR w.ticket < my_ticket)
      AND NOT (w.task_id = p_task AND w.sequence = p_sequence);

    IF p_requests_per_minute IS NOT NULL AND used_requests + ahead + 1 > p_requests_per_minute THEN
        why := 'requests_per_minute';
    ELSIF p_tokens_per_minute IS NOT NULL AND used_tokens + ahead_tokens > 0
          AND used_tokens + ahead_tokens + p_tokens > p_tokens_per_minute THEN
        -- (A call bigger than the whole window is admitted into an empty one rather than never.)
        why := 'tokens_per_minute';
    ELSIF p_max_concurrent IS NOT NULL AND in_flight + ahead + 1 > p_max_concurrent THEN
        why := 'max_concurrent_calls';
    END IF;

    IF why = '' THEN
        INSERT INTO model_quota_usage AS u (model, second, requests, tokens)
        VALUES (p_model, now_s, 1, p_tokens)
        ON CONFLICT (model, second) DO UPDATE SET requests = u.requests + 1, tokens = u.tokens + EXCLUDED.tokens;
        INSERT INTO model_quota_calls (task_id, sequence, attempt, model, second, estimated_tokens, admitted_at)
        VALUES (p_task, p_sequence, p_attempt, p_model, now_s, p_tokens, clock_timestamp());
        DELETE FROM model_quota_waiters w WHERE w.task_id = p_task AND w.sequence = p_sequence;
        IF random() < 0.01 THEN
            -- Now and then, forget what no window will read again.
            DELETE FROM model_quota_usage u WHERE u.model = p_model AND u.second <= now_s - 2 * p_span_seconds;
            DELETE FROM model_quota_waiters w
            WHERE w.model = p_model AND w.expires_at < clock_timestamp() - interval '10 minutes';
        END IF;
        RETURN QUERY SELECT true, 0::bigint, ''::text, 0;
        RETURN;
    END IF;

    -- When will this call's turn come? When enough of the window has moved out of it for the calls
    -- ahead of it and itself.
    IF why = 'requests_per_minute' THEN
        need := used_requests + ahead + 1 - p_requests_per_minute;
        SELECT min(x.second) INTO freed_at FROM (
            SELECT u.second, sum(u.requests) OVER (ORDER BY u.second) AS freed
            FROM model_quota_usage u WHERE u.model = p_model AND u.second > now_s - p_span_seconds
        ) x WHERE x.freed >= need;
    ELSIF why = 'tokens_per_minute' THEN
        need := used_tokens + ahead_tokens + p_tokens - p_tokens_per_minute;
        SELECT min(x.second) INTO freed_at FROM (
            SELECT u.second, sum(u.tokens) OVER (ORDER BY u.second) AS freed
            FROM model_quota_usage u WHERE u.model = p_model AND u.second > now_s - p_span_seconds
        ) x WHERE x.freed >= need;
    END IF;
    IF freed_at IS NOT NULL AND need > 0 THEN
        wait_ms := (freed_at + p_span_seconds) * 1000 - now_ms;
    ELSIF why = 'max_concurrent_calls' THEN
        -- A call in flight ends, or the calls ahead are admitted, at no time the engine can foresee.
        wait_ms := 200 + 20 * ahead;
    ELSE
        wait_ms := p_span_seconds * 1000;
    END IF;
    wait_ms := GREATEST(wait_ms, 50);
    -- In line (keeping the first ticket); a waiter that stops asking leaves the line after a grace.
    INSERT INTO model_quota_waiters AS w (task_id, sequence, model, tokens, arrived_at, expires_at)
    VALUES (p_task, p_sequence, p_model, p_tokens, clock_timestamp(),
            clock_timestamp() + make_interval(secs => (wait_ms + 5000) / 1000.0))
    ON CONFLICT (task_id, sequence) DO UPDATE SET expires_at = EXCLUDED.expires_at;
    RETURN QUERY SELECT false, wait_ms, why, ahead;
END
$$;
"""


def upgrade() -> None:
    op.create_table(
        "model_quota_usage",
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("second", sa.BigInteger, primary_key=True),
        sa.Column("requests", sa.Integer, nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "model_quota_calls",
        sa.Column("task_id", sa.Uuid, primary_key=True),
        sa.Column("sequence", sa.Integer, primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("second", sa.BigInteger, nullable=False),
        sa.Column("estimated_tokens", sa.BigInteger, nullable=False),
        sa.Column("admitted_at", TS, nullable=False),
    )
    op.create_index("model_quota_calls_model", "model_quota_calls", ["model"])
    op.create_table(
        "model_quota_waiters",
        sa.Column("task_id", sa.Uuid, primary_key=True),
        sa.Column("sequence", sa.Integer, primary_key=True),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("ticket", sa.BigInteger, sa.Identity(), nullable=False),
        sa.Column("tokens", sa.BigInteger, nullable=False),
        sa.Column("arrived_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
    )
    op.create_index("model_quota_waiters_line", "model_quota_waiters", ["model", "ticket"])
    op.execute(ADMIT_FUNCTION)


def downgrade() -> None:
    op.execute("DROP FUNCTION abada_admit_model_call")
    op.drop_table("model_quota_waiters")
    op.drop_table("model_quota_calls")
    op.drop_table("model_quota_usage")
