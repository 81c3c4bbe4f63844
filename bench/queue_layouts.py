"""The queue in two layouts beside N finished instances: finished tasks kept in `tasks`, or moved out.

Migrates a scratch database through the engine and fills N finished instances as bench/volume.py does
(default 1,000,000, with their tasks, history and journals). Beside the engine's `tasks`, where a
finished task stays as a row in state COMPLETED, it builds the other layout in a schema `split`:
`split.tasks` (the same columns, indexes and storage settings, built `LIKE tasks INCLUDING ALL`)
holding only open tasks, and `split.tasks_done` (primary key and instance index only) holding the
finished ones, copied from `tasks`. The engine's schema and code are not changed.

Each layout then runs the same task cycles from 8 connections, taking turns in rounds: a task is
created READY, leased by FetchAndLock's pick-and-lease statement (store/tasks.py LEASE_DUE, one topic,
the instance joined), and completed under its lease guard: in `tasks` an UPDATE to COMPLETED, in the
split layout a DELETE from the queue whose row goes to `tasks_done` in the same statement. A thousand
tasks of a topic nobody fetches stay open in each queue throughout, as other topics' backlog does.
Beside the cycles, the engine's queue upkeep (runtime/background/queue_upkeep.py) is played every
10 s against the layout running: VACUUM of the queue table once it holds 2,000 dead rows. This
machine's PostgreSQL runs with autovacuum off, so that is the only vacuum either queue gets.

Prints, per layout: cycles/s, FetchAndLock and Complete p50/p99, the upkeep's vacuums (how many, how
long each), WAL bytes a cycle, the pick's buffers after the cycles and after a VACUUM, and the
queue's size on disk.

    python bench/queue_layouts.py --volume 1000000 --cycles 100000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import volume
from abada_engine.db.migrate import migrate
from common import percentile, scratch_database
from sqlalchemy.ext.asyncio import create_async_engine

WORKERS = 8
ROUNDS = 5
BACKLOG = 1000
UPKEEP_SECONDS = 10.0
UPKEEP_DEAD_ROWS = 2000
LEASE_MS = 300_000
OPEN_STATES = "('READY', 'LEASED', 'WAITING', 'INCIDENT', 'AWAITING_APPROVAL', 'PARKED', 'PENDING')"
# Every column of `tasks`, in order, for copying a row between the split layout's two tables.
COLUMNS = (
    "id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at, lease_owner, "
    "lease_token_hash, lease_expires_at, last_error, created_at, completed_at, parked_on, waiting_since, "
    "outage_deadline, outage_waits, fan_out_id, item_index, item_result"
)
FINISHED_COLUMNS = (
    COLUMNS.replace("state,", "'COMPLETED',")
    .replace("completed_at,", "now(),")
    .replace("lease_token_hash,", "NULL,")
)


@dataclass
class Layout:
    name: str
    queue: str
    # The Complete of one leased task: $1 the task, $2 its lease token's hash.
    complete_sql: str
    fetches: list[float] = field(default_factory=list)
    completes: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    vacuums: list[float] = field(default_factory=list)
    wal_bytes: int = 0
    cycles: int = 0

    def insert_sql(self) -> str:
        return (
            f"INSERT INTO {self.queue} (id, instance_id, node_id, kind, topic, state, payload, retries_left) "
            "VALUES ($1, $2, 'work', 'external', $3, 'READY', '{}', 3)"
        )

    def lease_sql(self) -> str:
        # The engine's LEASE_DUE for one topic: pick with SKIP LOCKED in due order, lease, read the instance.
        return f"""
            WITH picked AS (
                SELECT t.id FROM {self.queue} t
                WHERE t.topic = 'bench' AND t.state IN ('READY', 'LEASED') AND t.due_at <= now()
                  AND t.state <> 'LEASED'
                ORDER BY t.due_at LIMIT 1 FOR UPDATE SKIP LOCKED
            )
            UPDATE {self.queue} t
            SET state = 'LEASED', attempt = t.attempt + 1, lease_owner = 'bench', lease_token_hash = $1,
                lease_expires_at = now() + {LEASE_MS} * interval '1 millisecond',
                due_at = now() + {LEASE_MS} * interval '1 millisecond'
            FROM picked, instances i
            WHERE t.id = picked.id AND i.id = t.instance_id
            RETURNING t.id, t.payload, i.variables, i.xmin::text
        """


GUARD = "state = 'LEASED' AND lease_owner = 'bench' AND lease_token_hash = $2 AND lease_expires_at > now()"
IN_PLACE = Layout(
    name="finished tasks kept in tasks",
    queue="tasks",
    complete_sql=(
        f"UPDATE tasks SET state = 'COMPLETED', completed_at = now(), lease_token_hash = NULL "
        f"WHERE id = $1 AND {GUARD}"
    ),
)
SPLIT = Layout(
    name="finished tasks moved to tasks_done",
    queue="split.tasks",
    complete_sql=(
        f"WITH done AS (DELETE FROM split.tasks WHERE id = $1 AND {GUARD} RETURNING *) "
        f"INSERT INTO split.tasks_done ({COLUMNS}) SELECT {FINISHED_COLUMNS} FROM done"
    ),
)
LAYOUTS = (IN_PLACE, SPLIT)


async def prepare(url: str, count: int) -> tuple[dict[str, float], list[uuid.UUID]]:
    """Migrates, fills `count` finished instances, builds the split layout and the open backlog; returns
    how long that took and the live instances the cycles' tasks belong to."""
    engine = create_async_engine(url.replace("postgresql://", "postgresql+asyncpg://", 1))
    try:
        await migrate(engine)
    finally:
        await engine.dispose()
    conn = await asyncpg.connect(url)
    try:
        for process in ("bench", "volume-agent"):
            await conn.execute(
                "INSERT INTO definitions (id, process_id, version, content_sha256, source_name, spec, "
                "tool_bindings) VALUES ($1, $2, 1, '', 'bench', '{}', '{}')",
                uuid.uuid4(),
                process,
            )
    finally:
        await conn.close()
    filled = await volume.fill(url, count)
    conn = await asyncpg.connect(url)
    try:
        began = time.perf_counter()
        await conn.execute("CREATE SCHEMA split")
        await conn.execute("CREATE TABLE split.tasks (LIKE tasks INCLUDING ALL)")
        await conn.execute("ALTER TABLE split.tasks ADD FOREIGN KEY (instance_id) REFERENCES instances (id)")
        options = await conn.fetchval("SELECT reloptions FROM pg_class WHERE oid = 'tasks'::regclass")
        if options:
            await conn.execute(f"ALTER TABLE split.tasks SET ({', '.join(options)})")
        await conn.execute("CREATE TABLE split.tasks_done (LIKE tasks INCLUDING DEFAULTS)")
        await conn.execute(
            f"INSERT INTO split.tasks_done SELECT * FROM tasks WHERE state NOT IN {OPEN_STATES}"
        )
        await conn.execute("ALTER TABLE split.tasks_done ADD PRIMARY KEY (id)")
        await conn.execute("CREATE INDEX ON split.tasks_done (instance_id)")
        await conn.execute(
            "ALTER TABLE split.tasks_done ADD FOREIGN KEY (instance_id) REFERENCES instances (id)"
        )
        await conn.execute("VACUUM ANALYZE split.tasks_done")
        filled["split_seconds"] = time.perf_counter() - began
        # The instances the cycles' tasks belong to, open as a running process's are.
        live = [uuid.uuid4() for _ in range(WORKERS * 4)]
        definition = await conn.fetchval("SELECT id FROM definitions WHERE process_id = 'bench'")
        await conn.executemany(
            "INSERT INTO instances (id, definition_id, process_id, version, state, variables, business_key) "
            "VALUES ($1, $2, 'bench', 1, 'ACTIVE', '{\"order\": 1}', 'live')",
            [(instance, definition) for instance in live],
        )
        for layout in LAYOUTS:
            await conn.executemany(
                layout.insert_sql(), [(uuid.uuid4(), live[n % len(live)], "backlog") for n in range(BACKLOG)]
            )
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return filled, live


async def cycle_round(url: str, layout: Layout, cycles: int, live: list[uuid.UUID]) -> None:
    """`cycles` task cycles from WORKERS connections, the upkeep played beside them."""
    connections = [await asyncpg.connect(url) for _ in range(WORKERS + 1)]
    upkeep_conn, workers = connections[0], connections[1:]
    remaining = iter(range(cycles))
    insert, lease, complete = layout.insert_sql(), layout.lease_sql(), layout.complete_sql

    async def worker(conn: asyncpg.Connection, n: int) -> None:
        for _ in remaining:
            await conn.execute(insert, uuid.uuid4(), live[n], "bench")
            token = os.urandom(32)
            began = time.perf_counter()
            leased = await conn.fetchrow(lease, token)
            layout.fetches.append(time.perf_counter() - began)
            if leased is None:
                continue
            began = time.perf_counter()
            done = await conn.execute(complete, leased["id"], token)
            layout.completes.append(time.perf_counter() - began)
            if not done.endswith(" 1"):
                raise RuntimeError(f"{layout.name}: a Complete under a live lease wrote nothing ({done})")

    async def upkeep(stop: asyncio.Event) -> None:
        table = layout.queue.split(".")[-1]
        schema = "split" if "." in layout.queue else "public"
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), UPKEEP_SECONDS)
            except TimeoutError:
                dead = await upkeep_conn.fetchval(
                    "SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = $1 AND relname = $2",
                    schema,
                    table,
                )
                if dead >= UPKEEP_DEAD_ROWS:
                    began = time.perf_counter()
                    await upkeep_conn.execute(f"VACUUM {layout.queue}")
                    layout.vacuums.append(time.perf_counter() - began)

    try:
        wal_before = await upkeep_conn.fetchval("SELECT pg_current_wal_lsn()")
        stop = asyncio.Event()
        upkeeper = asyncio.create_task(upkeep(stop))
        began = time.perf_counter()
        await asyncio.gather(*(worker(conn, n) for n, conn in enumerate(workers)))
        layout.rates.append(cycles / (time.perf_counter() - began))
        stop.set()
        await upkeeper
        layout.wal_bytes += int(
            await upkeep_conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)", wal_before)
        )
        layout.cycles += cycles
    finally:
        for conn in connections:
            await conn.close()


async def open_for_the_pick(url: str, layout: Layout) -> None:
    """1,000 open tasks of the fetched topic, as `volume.fetch_buffers` reads its pick among."""
    conn = await asyncpg.connect(url)
    try:
        instance = await conn.fetchval("SELECT id FROM instances WHERE business_key = 'live' LIMIT 1")
        await conn.executemany(layout.insert_sql(), [(uuid.uuid4(), instance, "bench") for _ in range(1000)])
    finally:
        await conn.close()


async def queue_bytes(url: str, layout: Layout) -> int:
    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", layout.queue))
    finally:
        await conn.close()


async def measure(url: str, count: int, cycles: int) -> dict[str, Any]:
    prepared, live = await prepare(url, count)
    # A warm-up round each, not counted: both layouts start from pages already read.
    for n, layout in enumerate(LAYOUTS):
        await cycle_round(url, layout, 2000, live[n * WORKERS : (n + 1) * WORKERS])
        layout.fetches.clear(), layout.completes.clear(), layout.rates.clear(), layout.vacuums.clear()
        layout.wal_bytes = layout.cycles = 0
    for _ in range(ROUNDS):
        for n, layout in enumerate(LAYOUTS):
            await cycle_round(url, layout, cycles // ROUNDS, live[n * WORKERS : (n + 1) * WORKERS])
    figures: dict[str, Any] = {"prepared": prepared}
    for layout in LAYOUTS:
        await open_for_the_pick(url, layout)
        after_cycles = await volume.fetch_buffers(url, layout.queue)
        conn = await asyncpg.connect(url)
        try:
            await conn.execute(f"VACUUM {layout.queue}")
        finally:
            await conn.close()
        figures[layout.name] = {
            "cycles/s (median of rounds)": sorted(layout.rates)[len(layout.rates) // 2],
            "FetchAndLock p50 ms": percentile(layout.fetches, 0.5) * 1000,
            "FetchAndLock p99 ms": percentile(layout.fetches, 0.99) * 1000,
            "Complete p50 ms": percentile(layout.completes, 0.5) * 1000,
            "Complete p99 ms": percentile(layout.completes, 0.99) * 1000,
            "upkeep vacuums": len(layout.vacuums),
            "upkeep vacuum s (mean)": sum(layout.vacuums) / len(layout.vacuums) if layout.vacuums else 0.0,
            "upkeep vacuum s (total)": sum(layout.vacuums),
            "WAL bytes a cycle": layout.wal_bytes / layout.cycles,
            "pick buffers after the cycles": after_cycles,
            "pick buffers after VACUUM": await volume.fetch_buffers(url, layout.queue),
            "queue table MB": await queue_bytes(url, layout) / 2**20,
        }
    return figures


def report(figures: dict[str, Any]) -> None:
    prepared = figures["prepared"]
    print(
        f"filled in {prepared['fill_seconds']:.0f} s ({prepared['database_bytes'] / 2**30:.2f} GiB); "
        f"split layout built in {prepared['split_seconds']:.0f} s"
    )
    kept, moved = figures[IN_PLACE.name], figures[SPLIT.name]
    print(f"| figure | {IN_PLACE.name} | {SPLIT.name} | split / kept |")
    print("|---|---|---|---|")
    for name, value in kept.items():
        other = moved[name]
        ratio = f"{other / value:.2f}x" if value else ""
        print(f"| {name} | {value:,.2f} | {other:,.2f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volume", type=int, default=1_000_000, help="finished instances to fill")
    parser.add_argument("--cycles", type=int, default=100_000, help="task cycles per layout")
    args = parser.parse_args()
    with scratch_database() as url:
        report(asyncio.run(measure(url, args.volume, args.cycles)))


if __name__ == "__main__":
    main()
