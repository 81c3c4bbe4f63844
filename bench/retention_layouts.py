"""Retention in two layouts: the engine's plain tables with batched deletes, beside tables partitioned by day.

Migrates a scratch database through the engine (as bench/retention.py does) and deploys two
processes, one keeping finished instances 30 days (P30D) and one 7 (P7D, one instance in four).
Fills it by SQL with finished instances spread evenly over the last 40 days: one agent task each
with 20 journal steps (1 KiB random bytes each way, as sealed payloads are) and 4 history rows.
Beside the engine's plain `journal_steps` and `history` it builds partitioned copies,
`CREATE TABLE ... (LIKE ...) PARTITION BY RANGE (created_at)`, one partition a day, holding the
same rows; the engine's schema and code are not changed.

Measured, one after the other on the same database (the engine stopped, nothing else in it):

1. the hot path on each layout, taking turns: single-row INSERTs shaped like an AppendStep (and a
   history row) from 8 concurrent connections, rows/s; the journal read by task id (the replay
   read, and the lease check's count of a task's steps), p50/p99;
2. row DELETEs of one process's rows whose days are not wholly expired (what a shorter retention,
   a purge or an erasure leaves to row deletes in a partitioned layout), like for like: the same
   batches of 500 instances from both layouts in turns, by task and instance ids as
   store/retention.py deletes, every other batch on the partitioned tables narrowed to the batch's
   time range so the planner prunes partitions;
3. deleting what expired: on the plain tables the engine's retention job (`runtime/retention.py`,
   batches of 500 instances with every row of theirs, flat out unless `--pause`); on the
   partitioned ones `DROP TABLE` of the day partitions every row of which has expired, then row
   DELETEs of the expired rows left in the other days (the P7D process's, the edge day's).

Prints one table: each figure on both layouts and their ratio.

    python bench/retention_layouts.py --journal-rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from abada_engine.runtime.retention import BATCH, Retention
from common import engine_process, percentile, scratch_database
from retention import PAYLOAD_POOL, create_payload_pool
from sqlalchemy.ext.asyncio import create_async_engine

STEPS_PER_TASK = 20
HISTORY_PER_INSTANCE = 4
DAYS = 40
# One instance in SHORT_EVERY keeps the short retention.
SHORT_EVERY = 4
LONG_DAYS, SHORT_DAYS = 30, 7
# Partitions for the days ahead, where the hot path's rows land.
DAYS_AHEAD = 7
DEFINITIONS = f"""
processes:
  - id: keep_month
    retention: P{LONG_DAYS}D
    start: agent
    nodes:
      - {{ id: agent, type: agent, model: gemini-3.6-flash, prompt: "Triage", result_variable: triage, next: done }}
      - {{ id: done, type: end }}
  - id: keep_week
    retention: P{SHORT_DAYS}D
    start: agent
    nodes:
      - {{ id: agent, type: agent, model: gemini-3.6-flash, prompt: "Triage", result_variable: triage, next: done }}
      - {{ id: done, type: end }}
"""

STEP_COLUMNS = (
    "task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version, request_ciphertext, "
    "response_ciphertext, request_digest, response_digest, input_tokens, output_tokens, abandoned, "
    "created_at, updated_at"
)
LAYOUTS = {"plain": ("journal_steps", "history"), "partitioned": ("journal_part", "history_part")}


@dataclass
class Figures:
    """What one run measured; rates in rows/s, latencies in ms."""

    fill_seconds: float = 0.0
    partitions: int = 0
    rates: dict[str, dict[str, float]] = field(default_factory=dict)
    latencies: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    deleted: dict[str, tuple[int, float]] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)
    # The journal DELETE's scans in the first batches of each row-delete phase.
    plans: dict[str, list[str]] = field(default_factory=dict)


async def fill(conn: asyncpg.Connection, journal_rows: int, chunk: int = 20_000) -> None:
    """Finished instances, one agent task each, their journal steps and history, started evenly over
    the last DAYS days and written in that order, as the engine writes them (a step's and a history
    row's time is its instance's start; each ran one minute)."""
    instances = max(1, journal_rows // STEPS_PER_TASK)
    month = await conn.fetchval("SELECT id FROM definitions WHERE process_id = 'keep_month'")
    week = await conn.fetchval("SELECT id FROM definitions WHERE process_id = 'keep_week'")
    for start in range(0, instances, chunk):
        count = min(chunk, instances - start)
        await conn.execute(
            """
            WITH spread AS (
              SELECT n, CASE WHEN n % $6 = 0 THEN $2::uuid ELSE $1::uuid END AS definition_id,
                     CASE WHEN n % $6 = 0 THEN 'keep_week' ELSE 'keep_month' END AS process_id,
                     now() - interval '1 minute' - ($8 - n) * ($5 * 86400.0 / $8) * interval '1 second' AS began
              FROM generate_series($3 + 1, $3 + $4) AS n
            ), made AS (
              INSERT INTO instances (id, definition_id, process_id, version, state, variables, current_node_id,
                                     business_key, created_at, ended_at)
              SELECT gen_random_uuid(), definition_id, process_id, 1, 'COMPLETED',
                     jsonb_build_object('customerId', 'C-' || n), 'done', 'K-' || n, began,
                     began + interval '1 minute'
              FROM spread RETURNING id, created_at
            ), hist AS (
              INSERT INTO history (instance_id, type, node_id, data, created_at)
              SELECT id, 'NODE_ENTERED', 'agent', '{}'::jsonb, created_at FROM made, generate_series(1, $7)
            )
            INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left,
                               due_at, created_at, completed_at, outage_waits)
            SELECT gen_random_uuid(), id, 'agent', 'external', 'abada:agent', 'COMPLETED', '{}'::jsonb, 1, 0,
                   created_at, created_at, created_at + interval '1 minute', 0
            FROM made
            """,
            month,
            week,
            start,
            count,
            DAYS,
            SHORT_EVERY,
            HISTORY_PER_INSTANCE,
            instances,
        )
    # As bench/retention.py fills: random bytes (ciphertext does not compress), a pool picked by step.
    await create_payload_pool(conn)
    # In time order, a task's steps together, as the engine appends them: the retention job's batches
    # (oldest first) then find their rows close together, in either layout.
    await conn.execute(
        f"""
        INSERT INTO journal_steps ({STEP_COLUMNS})
        SELECT o.id, o.s, 1, 'MODEL_CALL', 'COMPLETED', '', 'bench', 1, pool.bytes[o.s % $2 + 1],
               pool.bytes[(o.s + 1) % $2 + 1], NULL, NULL, 100, 10, false, o.created_at, o.created_at
        FROM (SELECT t.id, t.created_at, s FROM tasks t CROSS JOIN generate_series(1, $1) AS s
              WHERE t.topic = 'abada:agent' ORDER BY t.created_at, t.id, s) o
        CROSS JOIN (SELECT array_agg(bytes ORDER BY p) AS bytes FROM payloads) pool
        """,
        STEPS_PER_TASK,
        PAYLOAD_POOL,
    )


async def partition(conn: asyncpg.Connection, figures: Figures) -> None:
    """The partitioned copies, one partition a day from the oldest row to DAYS_AHEAD days ahead, with
    the indexes of the engine's tables that a partitioned table can hold, and the same rows."""
    # A unique index of a partitioned table must hold the partition key: the engine's keys cannot.
    for table, key in (("journal_steps", "task_id, sequence"), ("history", "instance_id, id")):
        await conn.execute(f"CREATE TABLE probe_part (LIKE {table}) PARTITION BY RANGE (created_at)")
        try:
            await conn.execute(f"ALTER TABLE probe_part ADD PRIMARY KEY ({key})")
        except asyncpg.PostgresError as error:
            figures.findings.append(
                f"PRIMARY KEY ({key}) on a partitioned {table}: {str(error).splitlines()[0]}"
            )
        finally:
            await conn.execute("DROP TABLE probe_part")
    await conn.execute(
        """
        CREATE TABLE journal_part (LIKE journal_steps INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
        PARTITION BY RANGE (created_at);
        ALTER TABLE journal_part ADD PRIMARY KEY (task_id, sequence, created_at);
        -- The engine's table references its task; a partitioned table can too (dropped before the deletes).
        ALTER TABLE journal_part ADD CONSTRAINT journal_part_task_id_fkey FOREIGN KEY (task_id) REFERENCES tasks (id);
        CREATE TABLE history_part (LIKE history INCLUDING DEFAULTS INCLUDING CONSTRAINTS)
        PARTITION BY RANGE (created_at);
        ALTER TABLE history_part ADD PRIMARY KEY (instance_id, id, created_at);
        -- PostgreSQL 15 has no identity column on a partitioned table: a sequence serves instead.
        CREATE SEQUENCE history_part_id_seq;
        ALTER TABLE history_part ALTER COLUMN id SET DEFAULT nextval('history_part_id_seq');
        """
    )
    first = await conn.fetchval("SELECT date_trunc('day', min(created_at)) FROM journal_steps")
    last = await conn.fetchval("SELECT date_trunc('day', now()) + $1 * interval '1 day'", DAYS_AHEAD)
    day = first
    while day <= last:
        following = await conn.fetchval("SELECT $1::timestamptz + interval '1 day'", day)
        suffix = day.strftime("%Y%m%d")
        for parent in ("journal_part", "history_part"):
            await conn.execute(
                f"CREATE TABLE {parent}_{suffix} PARTITION OF {parent} FOR VALUES FROM ('{day.isoformat()}') "
                f"TO ('{following.isoformat()}')"
            )
        figures.partitions += 1
        day = following
    await conn.execute(
        "INSERT INTO journal_part SELECT * FROM journal_steps; INSERT INTO history_part SELECT * FROM history;"
        "SELECT setval('history_part_id_seq', (SELECT max(id) FROM history_part))"
    )
    # AppendStep's idempotency is `ON CONFLICT (task_id, sequence) DO NOTHING` (store/journal_steps.py).
    try:
        await conn.execute(
            f"INSERT INTO journal_part ({STEP_COLUMNS}) SELECT {STEP_COLUMNS} FROM journal_steps WHERE false "
            "ON CONFLICT (task_id, sequence) DO NOTHING"
        )
    except asyncpg.PostgresError as error:
        figures.findings.append(
            f"AppendStep's ON CONFLICT (task_id, sequence) on the partitioned journal: {error}"
        )


async def inserts(
    url: str, sql: str, rows: list[tuple[object, ...]], connections: int, seconds: float
) -> float:
    """Single-row INSERTs, each its own transaction, from `connections` clients for `seconds`: rows/s.
    `rows` holds one argument tuple a connection; the second argument, if an int, counts up."""
    deadline = time.monotonic() + seconds
    counts = [0] * connections

    async def client(index: int) -> None:
        conn = await asyncpg.connect(url)
        statement = await conn.prepare(sql)
        arguments = list(rows[index])
        while time.monotonic() < deadline:
            await statement.fetch(*arguments)
            counts[index] += 1
            if isinstance(arguments[1], int):
                arguments[1] += 1
        await conn.close()

    begun = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(connections)))
    return sum(counts) / (time.monotonic() - begun)


async def hot_path(url: str, conn: asyncpg.Connection, figures: Figures, rounds: int, seconds: float) -> None:
    connections = 8
    # Tasks of today: their steps land in today's partition; sequences past the filled ones.
    recent = await conn.fetch(
        "SELECT t.id AS task_id, t.instance_id FROM tasks t ORDER BY t.created_at DESC LIMIT $1", connections
    )
    payload = os.urandom(1024)
    next_sequence = {layout: [1000 + i * 1_000_000 for i in range(connections)] for layout in LAYOUTS}
    for _ in range(rounds):
        for layout, (journal, history) in LAYOUTS.items():
            await conn.execute("CHECKPOINT")
            step = f"""
                INSERT INTO {journal} ({STEP_COLUMNS})
                VALUES ($1, $2, 1, 'MODEL_CALL', 'COMPLETED', '', 'bench', 1, $3, $3, $4, $4, 100, 10, false,
                        now(), now())"""
            rows: list[tuple[object, ...]] = [
                (r["task_id"], next_sequence[layout][i], payload, payload[:32]) for i, r in enumerate(recent)
            ]
            rate = await inserts(url, step, rows, connections, seconds)
            figures.rates.setdefault("AppendStep-shaped INSERT, 8 connections (rows/s)", {}).setdefault(
                layout, 0.0
            )
            figures.rates["AppendStep-shaped INSERT, 8 connections (rows/s)"][layout] += rate / rounds
            next_sequence[layout] = [s + int(rate * seconds) + 1000 for s in next_sequence[layout]]
            entry = f"""
                INSERT INTO {history} (instance_id, type, node_id, task_id, data, created_at)
                VALUES ($1, 'NODE_ENTERED', 'agent', $2, '{{}}'::jsonb, now())"""
            rows = [(r["instance_id"], r["task_id"]) for r in recent]
            rate = await inserts(url, entry, rows, connections, seconds)
            figures.rates.setdefault("history INSERT, 8 connections (rows/s)", {}).setdefault(layout, 0.0)
            figures.rates["history INSERT, 8 connections (rows/s)"][layout] += rate / rounds


async def reads(conn: asyncpg.Connection, figures: Figures, samples: int) -> None:
    """The journal of one task read on each layout in turn, `samples` random tasks."""
    task_ids = [r["id"] for r in await conn.fetch("SELECT id FROM tasks ORDER BY random() LIMIT $1", samples)]
    queries = {
        # store/journal_steps.py STEPS_OF: every journal read, every takeover's replay.
        "journal read by task id (replay)": "SELECT {columns} FROM {table} "
        "WHERE task_id = ANY($1::uuid[]) ORDER BY task_id, sequence",
        # The lease check's count of a task's steps before an append (APPEND_CONTEXT, no payloads).
        "steps counted by task id (lease check)": "SELECT count(*), COALESCE(sum(input_tokens + output_tokens), 0) "
        "FROM {table} WHERE task_id = ANY($1::uuid[])",
    }
    statements = {
        (name, layout): await conn.prepare(sql.format(columns=STEP_COLUMNS, table=tables[0]))
        for name, sql in queries.items()
        for layout, tables in LAYOUTS.items()
    }
    for statement in statements.values():  # warm: plans, and the pages of a few tasks
        for task_id in task_ids[:20]:
            await statement.fetch([task_id])
    for task_id in task_ids:
        for (name, layout), statement in statements.items():
            begun = time.perf_counter()
            await statement.fetch([task_id])
            figures.latencies.setdefault(name, {}).setdefault(layout, []).append(
                (time.perf_counter() - begun) * 1000
            )


@dataclass
class Expired:
    instance_id: uuid.UUID
    task_ids: list[uuid.UUID]
    created_at: datetime
    ended_at: datetime


async def deletes(
    url: str, conn: asyncpg.Connection, figures: Figures, pause: float, same_batch_instances: int
) -> None:
    await conn.execute("ALTER TABLE journal_part DROP CONSTRAINT journal_part_task_id_fkey")
    expired = [
        Expired(r["id"], list(r["task_ids"]), r["created_at"], r["ended_at"])
        for r in await conn.fetch(
            """
            SELECT i.id, i.created_at, i.ended_at, array_agg(t.id) AS task_ids
            FROM instances i JOIN definitions d ON d.id = i.definition_id JOIN tasks t ON t.instance_id = i.id
            WHERE i.state <> 'ACTIVE' AND i.ended_at < now() - d.retention_seconds * interval '1 second'
            GROUP BY i.id ORDER BY i.ended_at
            """
        )
    ]
    await same_batches(conn, figures, same_batch_instances, pause)

    # Plain: the engine's retention job, batches of BATCH instances, until nothing is due.
    await conn.execute("CHECKPOINT")
    db = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    retention = Retention(db, pause_seconds=pause)
    begun = time.perf_counter()
    while await retention.round():
        pass
    seconds = time.perf_counter() - begun
    await db.dispose()
    gone = retention.deleted.rows
    figures.deleted["plain: retention job, all tables"] = (retention.deleted.total, seconds)
    figures.deleted["plain: retention job, journal + history rows"] = (
        gone.get("journal_steps", 0) + gone.get("history", 0),
        seconds,
    )

    # Partitioned: the day partitions whose every row expired (an instance lives a minute here; a
    # real bound would be the longest retention plus the longest an instance runs).
    partitions = await conn.fetch(
        """
        SELECT c.relname, p.relname AS parent,
               (regexp_match(pg_get_expr(c.relpartbound, c.oid), 'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS upper
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
        WHERE p.relname IN ('journal_part', 'history_part') ORDER BY upper
        """
    )
    cutoff = await conn.fetchval("SELECT now() - $1 * interval '1 day' - interval '1 minute'", LONG_DAYS)
    droppable = [r for r in partitions if r["upper"] <= cutoff]
    counts = {r["relname"]: await conn.fetchval(f"SELECT count(*) FROM {r['relname']}") for r in droppable}
    kept_from = max((r["upper"] for r in droppable), default=None)
    await conn.execute("CHECKPOINT")
    begun = time.perf_counter()
    for index, r in enumerate(droppable):
        if index == 0:
            async with conn.transaction():
                await conn.execute(f"DROP TABLE {r['relname']}")
                mode = await conn.fetchval(
                    "SELECT string_agg(mode, ', ') FROM pg_locks WHERE relation = $1::regclass AND pid = pg_backend_pid()",
                    r["parent"],
                )
            figures.findings.append(f"DROP TABLE of a partition holds {mode} on its parent {r['parent']}")
        else:
            await conn.execute(f"DROP TABLE {r['relname']}")
    seconds = time.perf_counter() - begun
    figures.deleted[f"partitioned: DROP TABLE of {len(droppable) // 2} expired days, journal + history"] = (
        sum(counts.values()),
        seconds,
    )

    # Partitioned: the expired rows in partitions that stay (the P7D process's, the edge day's), in
    # batches of instances, every other batch narrowed to its time range.
    rest = [e for e in expired if kept_from is None or e.created_at >= kept_from]
    totals: dict[bool, list[float]] = {True: [0, 0.0], False: [0, 0.0]}
    await conn.execute("CHECKPOINT")
    for index, start in enumerate(range(0, len(rest), BATCH)):
        plans = figures.plans.setdefault("the rest", []) if index < 2 else None
        rows, took = await delete_batch(
            conn, "partitioned", rest[start : start + BATCH], index % 2 == 0, plans
        )
        totals[index % 2 == 0][0] += rows
        totals[index % 2 == 0][1] += took
        if pause:
            await asyncio.sleep(pause)
    for pruned, (count, seconds) in totals.items():
        name = "narrowed to the batch's days" if pruned else "every partition searched"
        figures.deleted[f"partitioned: row DELETE of the rest ({name}), journal + history"] = (
            int(count),
            seconds,
        )


def scans(plan: list[dict[str, Any]]) -> str:
    """The scans a plan runs, counted by kind: "38 Index Scan, 10 Seq Scan"."""
    found: dict[str, int] = {}

    def visit(node: dict[str, Any]) -> None:
        if "Scan" in node["Node Type"] and "Relation Name" in node:
            found[node["Node Type"]] = found.get(node["Node Type"], 0) + 1
        for child in node.get("Plans", []):
            visit(child)

    visit(plan[0]["Plan"])
    return ", ".join(f"{count} {kind}" for kind, count in sorted(found.items()))


async def delete_batch(
    conn: asyncpg.Connection, layout: str, batch: list[Expired], pruned: bool, plans: list[str] | None = None
) -> tuple[int, float]:
    """Delete a batch of instances' journal steps (by task id) and history (by instance id), as
    store/retention.py does, in one transaction: rows, seconds. `pruned` narrows both statements to the
    batch's time range (a row's created_at lies between its instance's start and end), so a
    partitioned table searches only the partitions that range covers instead of every one. With
    `plans`, the journal statement's plan (its scans) is added to it first."""
    journal, history = LAYOUTS[layout]
    narrow = " AND created_at >= $2 AND created_at <= $3" if pruned else ""
    bounds = [min(e.created_at for e in batch), max(e.ended_at for e in batch)] if pruned else []
    task_ids = [t for e in batch for t in e.task_ids]
    if plans is not None:
        plan = await conn.fetchval(
            f"EXPLAIN (FORMAT JSON) DELETE FROM {journal} WHERE task_id = ANY($1::uuid[]){narrow}",
            task_ids,
            *bounds,
        )
        plans.append(f"{layout}{', narrowed' if pruned else ''}: {scans(json.loads(plan))}")
    begun = time.perf_counter()
    async with conn.transaction():
        steps = await conn.execute(
            f"DELETE FROM {journal} WHERE task_id = ANY($1::uuid[]){narrow}", task_ids, *bounds
        )
        entries = await conn.execute(
            f"DELETE FROM {history} WHERE instance_id = ANY($1::uuid[]){narrow}",
            [e.instance_id for e in batch],
            *bounds,
        )
    return int(steps.split()[-1]) + int(entries.split()[-1]), time.perf_counter() - begun


async def same_batches(conn: asyncpg.Connection, figures: Figures, instances: int, pause: float) -> None:
    """One process's rows in days not wholly expired (a shorter retention, a purge), like for like:
    the same batches of instances deleted from both layouts, in turns, plain all by ids, partitioned
    every other batch narrowed to the batch's days. The instances are of the P30D process, 8-29 days
    old, oldest first as the job takes them: none of them is due, so the job leaves them be."""
    chosen = [
        Expired(r["id"], list(r["task_ids"]), r["created_at"], r["ended_at"])
        for r in await conn.fetch(
            """
            SELECT i.id, i.created_at, i.ended_at, array_agg(t.id) AS task_ids
            FROM instances i JOIN tasks t ON t.instance_id = i.id
            WHERE i.process_id = 'keep_month' AND i.ended_at < now() - $1 * interval '1 day'
              AND i.ended_at > now() - $2 * interval '1 day'
            GROUP BY i.id ORDER BY i.ended_at LIMIT $3
            """,
            SHORT_DAYS + 1,
            LONG_DAYS - 1,
            instances,
        )
    ]
    totals: dict[tuple[str, bool], list[float]] = {}
    await conn.execute("CHECKPOINT")
    for index, start in enumerate(range(0, len(chosen), BATCH)):
        batch, pruned = chosen[start : start + BATCH], index % 2 == 0
        # Which layout goes first alternates too, so neither always finds the other's pages cached.
        order = ("plain", "partitioned") if index % 4 < 2 else ("partitioned", "plain")
        for layout in order:
            plans = figures.plans.setdefault("same batches", []) if index < 2 else None
            rows, took = await delete_batch(conn, layout, batch, pruned and layout == "partitioned", plans)
            total = totals.setdefault((layout, pruned), [0, 0.0])
            total[0] += rows
            total[1] += took
            if pause:
                await asyncio.sleep(pause)
    for pruned, name in ((False, "every partition searched"), (True, "narrowed to the batch's days")):
        key = f"row DELETE, same batches of {BATCH} instances, partitioned {name} (rows/s)"
        if all((layout, pruned) in totals for layout in LAYOUTS):
            figures.rates[key] = {
                layout: totals[(layout, pruned)][0] / totals[(layout, pruned)][1] for layout in LAYOUTS
            }


async def _measure(
    url: str, journal_rows: int, rounds: int, seconds: float, samples: int, pause: float
) -> Figures:
    # An eighth of the instances go through the like-for-like row deletes (of some 21 days' worth).
    same_batch_instances = journal_rows // STEPS_PER_TASK // 8
    figures = Figures()
    with engine_process(url, {"ABADA_RETENTION_ROUND_SECONDS": "0"}) as engine:
        async with engine.channel() as channel:
            from abada.engine.v1 import definition_pb2, definition_pb2_grpc

            await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
                definition_pb2.DeployRequest(source_name="retention.yaml", content=DEFINITIONS)
            )
    # The engine is stopped: nothing but this bench touches the database from here on.
    conn = await asyncpg.connect(url)
    try:
        begun = time.perf_counter()
        await fill(conn, journal_rows)
        await partition(conn, figures)
        await conn.execute("VACUUM ANALYZE")
        # How closely the plain journal's physical order follows time (1: as the engine appends).
        correlation = await conn.fetchval(
            "SELECT correlation FROM pg_stats WHERE tablename = 'journal_steps' AND attname = 'created_at'"
        )
        figures.findings.append(
            f"plain journal_steps: created_at's physical order correlation {correlation:.3f}"
        )
        figures.fill_seconds = time.perf_counter() - begun
        await hot_path(url, conn, figures, rounds, seconds)
        await reads(conn, figures, samples)
        await deletes(url, conn, figures, pause, same_batch_instances)
    finally:
        await conn.close()
    return figures


def measure(
    journal_rows: int = 1_000_000,
    rounds: int = 5,
    seconds: float = 3.0,
    samples: int = 2000,
    pause: float = 0.0,
) -> Figures:
    with scratch_database() as url:
        return asyncio.run(_measure(url, journal_rows, rounds, seconds, samples, pause))


def report(figures: Figures, journal_rows: int) -> None:
    print(
        f"{journal_rows:,} journal rows over {DAYS} days, {figures.partitions} day partitions "
        f"(filled, copied and vacuumed in {figures.fill_seconds:.0f} s)"
    )
    width = max(len(name) for name in [*figures.rates, *figures.deleted]) + 1
    print(f"{'figure':<{width}} {'plain':>12} {'partitioned':>12} {'part/plain':>10}")
    for name, by_layout in figures.rates.items():
        plain, part = by_layout["plain"], by_layout["partitioned"]
        print(f"{name:<{width}} {plain:>12,.0f} {part:>12,.0f} {part / plain:>9.2f}x")
    for name, samples in figures.latencies.items():
        for label, fraction in (("p50", 0.5), ("p99", 0.99)):
            plain, part = percentile(samples["plain"], fraction), percentile(samples["partitioned"], fraction)
            print(f"{f'{name} {label} (ms)':<{width}} {plain:>12.3f} {part:>12.3f} {part / plain:>9.2f}x")
    print(f"{'deleted':<{width}} {'rows':>12} {'seconds':>12} {'rows/s':>10}")
    for name, (rows, seconds) in figures.deleted.items():
        print(f"{name:<{width}} {rows:>12,} {seconds:>12.2f} {rows / seconds if seconds else 0:>10,.0f}")
    for finding in figures.findings:
        print(f"- {finding}")
    for phase, plans in figures.plans.items():
        print(f"- journal DELETE plans, {phase}: " + "; ".join(plans))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--journal-rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=5, help="turns of the INSERT figures on each layout")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each INSERT turn")
    parser.add_argument("--samples", type=int, default=2000, help="tasks read on each layout")
    parser.add_argument(
        "--pause", type=float, default=0.0, help="seconds between delete batches (default: none, flat out)"
    )
    args = parser.parse_args()
    report(measure(args.journal_rows, args.rounds, args.seconds, args.samples, args.pause), args.journal_rows)


if __name__ == "__main__":
    main()
