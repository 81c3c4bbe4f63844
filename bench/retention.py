"""Retention beside live traffic: rows deleted per second, and task cycles with and without it.

Fills the database with finished instances past their retention by SQL (one agent task each, with
20 journal steps of 1 KiB sealed payloads each way, random bytes as ciphertext is, and 4 history
rows), 10 million journal rows by default.
Then, on one engine: task cycles (8 workers completing one-node instances) alone, and the same
cycles while the retention job deletes the old instances in its batches, the way a replica runs it
(runtime/retention.py, from this process against the same database). Prints rows deleted per second
(all tables, and journal rows alone) and the two cycle rates.

    python bench/retention.py --journal-rows 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import time

import asyncpg
from abada_engine.runtime.retention import Retention
from common import engine_process, scratch_database
from sqlalchemy.ext.asyncio import create_async_engine
from task_cycle import create_instances, run_workers

STEPS_PER_TASK = 20
HISTORY_PER_INSTANCE = 4
PAYLOAD_POOL = 64
OLD = """
processes:
  - id: old_triage
    retention: P30D
    start: agent
    nodes:
      - { id: agent, type: agent, model: gemini-3.6-flash, prompt: "Triage", result_variable: triage, next: done }
      - { id: done, type: end }
"""


async def create_payload_pool(conn: asyncpg.Connection) -> None:
    """The temporary table `payloads` (p, bytes): PAYLOAD_POOL payloads of 1 KiB, picked by step.
    Ciphertext does not compress, so they are random bytes: PostgreSQL stores them as it stores real
    ones, one of a step's two out of line in the TOAST table."""
    await conn.execute(
        """
        CREATE TEMP TABLE payloads AS
        SELECT p, decode(string_agg(lpad(to_hex((random() * 4294967295)::bigint), 8, '0'), ''), 'hex') AS bytes
        FROM generate_series(0, $1 - 1) AS p, generate_series(1, 256) GROUP BY p
        """,
        PAYLOAD_POOL,
    )


async def fill(database_url: str, journal_rows: int, chunk: int = 20_000) -> float:
    """Finished instances (ended 40 days ago) with their tasks, journal steps and history, by SQL in
    chunks of `chunk` instances; answers the seconds it took."""
    instances = max(1, journal_rows // STEPS_PER_TASK)
    begun = time.perf_counter()
    conn = await asyncpg.connect(database_url)
    try:
        definition = await conn.fetchval("SELECT id FROM definitions WHERE process_id = 'old_triage'")
        for start in range(0, instances, chunk):
            count = min(chunk, instances - start)
            await conn.execute(
                """
                WITH made AS (
                  INSERT INTO instances (id, definition_id, process_id, version, state, variables, current_node_id,
                                         business_key, created_at, ended_at)
                  SELECT gen_random_uuid(), $1, 'old_triage', 1, 'COMPLETED',
                         jsonb_build_object('customerId', 'C-' || n), 'done', 'K-' || n,
                         now() - interval '41 days', now() - interval '40 days'
                  FROM generate_series(1, $2) AS n RETURNING id
                ), hist AS (
                  INSERT INTO history (instance_id, type, node_id, data, created_at)
                  SELECT id, 'NODE_ENTERED', 'agent', '{}'::jsonb, now() - interval '41 days'
                  FROM made, generate_series(1, $3)
                )
                INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left,
                                   due_at, created_at, completed_at, outage_waits)
                SELECT gen_random_uuid(), id, 'agent', 'external', 'abada:agent', 'COMPLETED', '{}'::jsonb, 1, 0,
                       now() - interval '41 days', now() - interval '41 days', now() - interval '40 days', 0
                FROM made
                """,
                definition,
                count,
                HISTORY_PER_INSTANCE,
            )
        # The journal of every old task: 1 KiB of "sealed" payload each way a step.
        await create_payload_pool(conn)
        await conn.execute(
            """
            INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version,
                                       request_ciphertext, response_ciphertext, input_tokens, output_tokens,
                                       abandoned, created_at, updated_at)
            SELECT t.id, s, 1, 'MODEL_CALL', 'COMPLETED', '', 'bench', 1, request.bytes, response.bytes, 100, 10,
                   false, now() - interval '41 days', now() - interval '41 days'
            FROM tasks t
            CROSS JOIN generate_series(1, $1) AS s
            JOIN payloads request ON request.p = s % $2
            JOIN payloads response ON response.p = (s + 1) % $2
            WHERE t.topic = 'abada:agent'
            """,
            STEPS_PER_TASK,
            PAYLOAD_POOL,
        )
        await conn.execute("ANALYZE")
    finally:
        await conn.close()
    return time.perf_counter() - begun


async def _measure(
    database_url: str, journal_rows: int, cycles: int, pause: float | None
) -> dict[str, float]:
    # The engine's own retention rounds stay off: this process runs the job, so it can count the rows.
    with engine_process(database_url, {"ABADA_RETENTION_ROUND_SECONDS": "0"}) as engine:
        async with engine.channel() as channel:
            from abada.engine.v1 import definition_pb2, definition_pb2_grpc

            await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
                definition_pb2.DeployRequest(source_name="old.yaml", content=OLD)
            )
        filled = await fill(database_url, journal_rows)
        await create_instances(engine, cycles)
        alone = await run_workers(engine, cycles, 8, 16)
        db = create_async_engine(database_url.replace("postgresql://", "postgresql+asyncpg://", 1))
        retention = Retention(db) if pause is None else Retention(db, pause_seconds=pause)
        deleting = True

        async def job() -> float:
            begun = time.perf_counter()
            while deleting and await retention.round():
                pass
            return time.perf_counter() - begun

        try:
            await create_instances(engine, cycles)
            running = asyncio.create_task(job())
            await asyncio.sleep(1.0)  # the job under way before the cycles start
            beside = await run_workers(engine, cycles, 8, 16)
            seconds = await running
        finally:
            deleting = False
            await db.dispose()
    rows = retention.deleted.total
    journal = retention.deleted.rows.get("journal_steps", 0)
    return {
        "fill_seconds": filled,
        "rows_per_second": rows / seconds,
        "journal_rows_per_second": journal / seconds,
        "rows": float(rows),
        "journal_rows": float(journal),
        "seconds": seconds,
        "cycles_alone": float(alone["rate"]),  # type: ignore[arg-type]
        "cycles_beside": float(beside["rate"]),  # type: ignore[arg-type]
        "slowdown": float(alone["rate"]) / float(beside["rate"]),  # type: ignore[arg-type]
    }


def measure(
    journal_rows: int = 10_000_000, cycles: int = 3000, pause: float | None = None
) -> dict[str, float]:
    """One run; `pause` overrides the job's pause between batches (seconds)."""
    with scratch_database() as url:
        return asyncio.run(_measure(url, journal_rows, cycles, pause))


def report(result: dict[str, float], journal_rows: int) -> None:
    print(
        f"retention beside {journal_rows:,} journal rows (filled in {result['fill_seconds']:.0f} s): "
        f"{result['rows']:,.0f} rows in {result['seconds']:.1f} s = {result['rows_per_second']:,.0f} rows/s "
        f"({result['journal_rows_per_second']:,.0f} journal rows/s); task cycles "
        f"{result['cycles_alone']:,.0f}/s alone, {result['cycles_beside']:,.0f}/s beside it "
        f"= {result['slowdown']:.2f}x slower"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--journal-rows", type=int, default=10_000_000)
    parser.add_argument("--cycles", type=int, default=3000, help="task cycles in each of the two rounds")
    parser.add_argument(
        "--pause", type=float, default=None, help="seconds between batches (default: the job's)"
    )
    args = parser.parse_args()
    report(measure(args.journal_rows, args.cycles, args.pause), args.journal_rows)


if __name__ == "__main__":
    main()
