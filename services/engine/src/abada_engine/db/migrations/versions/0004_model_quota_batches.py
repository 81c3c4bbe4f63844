"""Model quotas: admit a batch of model calls under one lock, in arrival order; settle a call in the
transaction that journals its finished step; corrections in counter rows of their own.
"""

from __future__ import annotations

import sqlalchemy as sa
from abada_engine.db.migrations.earlier_revisions import constant_from
from alembic import op

revision = "0004"
down_revision = "0003"

# Each engine replica queues the STARTED admissions of a model that arrive while its previous batch is
# in the database, and admits them with one call of this function: one round trip, one transaction,
# one acquisition of the model's lock for the whole batch, instead of one each (which serialised every
# admission of a model across replicas). Inside, the calls are decided one by one in the order given
# (the replica's order of arrival), exactly as the one-call function of migration 0002 decided them,
# with the window's usage read once and carried along:
#
# - the lock, then a fresh snapshot per statement (PL/pgSQL), so the usage read includes every
#   admission committed before the lock was granted, on any replica;
# - a call already admitted (a retried STARTED, here or in this very batch) is admitted again and
#   counted once;
# - the waiting line keeps arrival order per model: a call is admitted only when what is left of the
#   window also covers every live waiter that arrived before it; a call refused in this batch joins
#   the line at once, so the later calls of the same batch count it as ahead of them;
# - the usage of the calls admitted so far is written (one upsert of the second's counter row, not
#   one per call) before a refusal computes its wait from the table, and at the end.
#
# A model call is settled in the transaction that journals its finished step, by a trigger: the
# step's real tokens replace the estimate the call was admitted with (as a correction in the second
# it was admitted), and its row leaves the admitted calls, freeing its concurrency slot. So the
# COMPLETED step costs the worker one round trip, as without a quota, and an admission decided after
# it was journaled counts its real tokens, on any replica. A call journaled without quota has no
# admitted row: the trigger finds nothing to settle.
SETTLE_TRIGGER = """
CREATE FUNCTION abada_settle_model_call() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    settled record;
BEGIN
    DELETE FROM model_quota_calls c WHERE c.task_id = NEW.task_id AND c.sequence = NEW.sequence
    RETURNING c.model, c.second, c.estimated_tokens INTO settled;
    IF FOUND THEN
        INSERT INTO model_quota_usage AS u (model, second, slot, requests, tokens)
        VALUES (settled.model, settled.second, CAST(1 + pg_backend_pid() % 8 AS smallint), 0,
                NEW.input_tokens + NEW.output_tokens - settled.estimated_tokens)
        ON CONFLICT (model, second, slot) DO UPDATE SET tokens = u.tokens + EXCLUDED.tokens;
    END IF;
    RETURN NULL;
END
$$
"""
SETTLE_ON_FINISH = """
CREATE TRIGGER journal_steps_settle_model_call AFTER UPDATE OF state ON journal_steps
FOR EACH ROW WHEN (OLD.state = 'STARTED' AND NEW.state IN ('COMPLETED', 'FAILED') AND NEW.kind = 'MODEL_CALL')
EXECUTE FUNCTION abada_settle_model_call()
"""

# The usage stays counter rows per model and second, updated in place: a window's sum reads a few rows
# a second, however many calls it holds. Slot 0 of a second is the admissions' own, written only
# under the model's lock; settlements and releases add their corrections to slots 1-8 (picked by the
# server process), so a settlement never holds the row an admission waits for while it holds the lock,
# nor waits for it. The window is the sum over the slots. It is a logged table on purpose: an UNLOGGED one is emptied by
# PostgreSQL's crash recovery, which would forget a whole minute of admissions and let a restarted
# database admit up to twice the quota in that minute. Commits skip the WAL flush instead: a crash of
# PostgreSQL itself may forget the last few milliseconds of admissions, once.
ADMIT_BATCH_FUNCTION = """
CREATE FUNCTION abada_admit_model_calls(
    p_model text, p_tasks uuid[], p_sequences integer[], p_attempts integer[], p_tokens bigint[],
    p_requests_per_minute integer, p_tokens_per_minute bigint, p_max_concurrent integer,
    p_span_seconds integer
) RETURNS TABLE (call_index integer, admitted boolean, retry_after_ms bigint, reason text, waiting_ahead integer)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    n integer := coalesce(array_length(p_tasks, 1), 0);
    i integer;
    now_ms bigint;
    now_s bigint;
    used_requests bigint;
    used_tokens bigint;
    in_flight integer := 0;
    -- Admitted in this batch and not yet added to the second's counter row.
    pending_requests integer := 0;
    pending_tokens bigint := 0;
    -- Whether the model has any waiter row at all (live or not): without one, nobody is ahead and
    -- there is no ticket to look up or row to delete.
    line_exists boolean;
    my_ticket bigint;
    ahead integer;
    ahead_tokens bigint;
    why text;
    need bigint;
    freed_at bigint;
    wait_ms bigint;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtextextended('abada.model_quota:' || p_model, 0));
    now_ms := floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint;
    now_s := now_ms / 1000;
    SELECT COALESCE(sum(u.requests), 0), COALESCE(sum(u.tokens), 0) INTO used_requests, used_tokens
    FROM model_quota_usage u WHERE u.model = p_model AND u.second > now_s - p_span_seconds;
    IF p_max_concurrent IS NOT NULL THEN
        SELECT count(*) INTO in_flight
        FROM model_quota_calls c JOIN tasks t ON t.id = c.task_id
        WHERE c.model = p_model AND t.state = 'LEASED' AND t.attempt = c.attempt
          AND t.lease_expires_at > clock_timestamp();
    END IF;
    line_exists := EXISTS (SELECT 1 FROM model_quota_waiters w WHERE w.model = p_model);

    FOR i IN 1 .. n LOOP
        call_index := i;
        IF EXISTS (
            SELECT 1 FROM model_quota_calls c WHERE c.task_id = p_tasks[i] AND c.sequence = p_sequences[i]
        ) THEN
            -- The same STARTED again (a retried request): admitted once, counted once.
            admitted := true; retry_after_ms := 0; reason := ''; waiting_ahead := 0;
            RETURN NEXT;
            CONTINUE;
        END IF;
        my_ticket := NULL;
        ahead := 0;
        ahead_tokens := 0;
        IF line_exists THEN
            SELECT w.ticket INTO my_ticket FROM model_quota_waiters w
            WHERE w.task_id = p_tasks[i] AND w.sequence = p_sequences[i];
            SELECT count(*), COALESCE(sum(w.tokens), 0) INTO ahead, ahead_tokens FROM model_quota_waiters w
            WHERE w.model = p_model AND w.expires_at > clock_timestamp()
              AND (my_ticket IS NULL OR w.ticket < my_ticket)
              AND NOT (w.task_id = p_tasks[i] AND w.sequence = p_sequences[i]);
        END IF;

        why := '';
        IF p_requests_per_minute IS NOT NULL AND used_requests + ahead + 1 > p_requests_per_minute THEN
            why := 'requests_per_minute';
        ELSIF p_tokens_per_minute IS NOT NULL AND used_tokens + ahead_tokens > 0
              AND used_tokens + ahead_tokens + p_tokens[i] > p_tokens_per_minute THEN
            -- (A call bigger than the whole window is admitted into an empty one rather than never.)
            why := 'tokens_per_minute';
        ELSIF p_max_concurrent IS NOT NULL AND in_flight + ahead + 1 > p_max_concurrent THEN
            why := 'max_concurrent_calls';
        END IF;

        IF why = '' THEN
            used_requests := used_requests + 1;
            used_tokens := used_tokens + p_tokens[i];
            pending_requests := pending_requests + 1;
            pending_tokens := pending_tokens + p_tokens[i];
            in_flight := in_flight + 1;
            INSERT INTO model_quota_calls (task_id, sequence, attempt, model, second, estimated_tokens, admitted_at)
            VALUES (p_tasks[i], p_sequences[i], p_attempts[i], p_model, now_s, p_tokens[i], clock_timestamp());
            IF line_exists THEN
                DELETE FROM model_quota_waiters w WHERE w.task_id = p_tasks[i] AND w.sequence = p_sequences[i];
            END IF;
            admitted := true; retry_after_ms := 0; reason := ''; waiting_ahead := 0;
            RETURN NEXT;
            CONTINUE;
        END IF;

        IF pending_requests > 0 THEN
            INSERT INTO model_quota_usage AS u (model, second, slot, requests, tokens)
            VALUES (p_model, now_s, 0, pending_requests, pending_tokens)
            ON CONFLICT (model, second, slot) DO UPDATE SET requests = u.requests + EXCLUDED.requests,
                tokens = u.tokens + EXCLUDED.tokens;
            pending_requests := 0;
            pending_tokens := 0;
        END IF;
        -- When will this call's turn come? When enough of the window has moved out of it for the
        -- calls ahead of it and itself.
        freed_at := NULL;
        need := 0;
        IF why = 'requests_per_minute' THEN
            need := used_requests + ahead + 1 - p_requests_per_minute;
            SELECT min(x.second) INTO freed_at FROM (
                SELECT u.second, sum(u.requests) OVER (ORDER BY u.second) AS freed
                FROM model_quota_usage u WHERE u.model = p_model AND u.second > now_s - p_span_seconds
            ) x WHERE x.freed >= need;
        ELSIF why = 'tokens_per_minute' THEN
            need := used_tokens + ahead_tokens + p_tokens[i] - p_tokens_per_minute;
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
        VALUES (p_tasks[i], p_sequences[i], p_model, p_tokens[i], clock_timestamp(),
                clock_timestamp() + make_interval(secs => (wait_ms + 5000) / 1000.0))
        ON CONFLICT (task_id, sequence) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        line_exists := true;
        admitted := false; retry_after_ms := wait_ms; reason := why; waiting_ahead := ahead;
        RETURN NEXT;
    END LOOP;

    IF pending_requests > 0 THEN
        INSERT INTO model_quota_usage AS u (model, second, slot, requests, tokens)
        VALUES (p_model, now_s, 0, pending_requests, pending_tokens)
        ON CONFLICT (model, second, slot) DO UPDATE SET requests = u.requests + EXCLUDED.requests,
            tokens = u.tokens + EXCLUDED.tokens;
    END IF;
    IF random() < 0.01 THEN
        -- Now and then, forget what no window will read again.
        DELETE FROM model_quota_usage u WHERE u.model = p_model AND u.second <= now_s - 2 * p_span_seconds;
        DELETE FROM model_quota_waiters w
        WHERE w.model = p_model AND w.expires_at < clock_timestamp() - interval '10 minutes';
    END IF;
END
$$;
"""


def upgrade() -> None:
    op.execute(SETTLE_TRIGGER)
    op.execute(SETTLE_ON_FINISH)
    op.add_column("model_quota_usage", sa.Column("slot", sa.SmallInteger, nullable=False, server_default="0"))
    op.drop_constraint("model_quota_usage_pkey", "model_quota_usage", type_="primary")
    op.create_primary_key("model_quota_usage_pkey", "model_quota_usage", ["model", "second", "slot"])
    op.alter_column("model_quota_usage", "slot", server_default=None)
    op.execute(ADMIT_BATCH_FUNCTION)
    op.execute("DROP FUNCTION abada_admit_model_call")


def downgrade() -> None:
    # Migration 0002's one-call function, back as that revision wrote it.
    op.execute(constant_from("0002_model_quotas.py", "ADMIT_FUNCTION"))
    op.execute("DROP FUNCTION abada_admit_model_calls")
    op.execute("DROP TRIGGER journal_steps_settle_model_call ON journal_steps")
    op.execute("DROP FUNCTION abada_settle_model_call")
    # The corrections fold back into one row a second.
    op.execute(
        """
        CREATE TEMPORARY TABLE folded ON COMMIT DROP AS
        SELECT model, second, GREATEST(0, sum(requests))::integer AS requests,
               GREATEST(0, sum(tokens))::bigint AS tokens
        FROM model_quota_usage GROUP BY model, second
        """
    )
    op.execute("DELETE FROM model_quota_usage")
    op.drop_constraint("model_quota_usage_pkey", "model_quota_usage", type_="primary")
    op.drop_column("model_quota_usage", "slot")
    op.create_primary_key("model_quota_usage_pkey", "model_quota_usage", ["model", "second"])
    op.execute("INSERT INTO model_quota_usage SELECT model, second, requests, tokens FROM folded")
