"""The peer for task cycles: pgqueuer (a lean PostgreSQL job queue) draining N no-op jobs.

Run on the same PostgreSQL, in the same run, as `task_cycle.py`: C consumers (each a QueueManager
with its own connection) dequeue batches of B and acknowledge every job. The rate counts from the
first dequeue until every consumer has drained the queue and flushed its acknowledgements.

    python bench/pgqueuer_peer.py --jobs 5000 --consumers 8 --batch 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import timedelta

import asyncpg
from common import scratch_database

JOBS_PER_ENQUEUE = 1000


async def pgqueuer_rate(database_url: str, jobs: int, consumers: int = 8, batch: int = 4) -> float:
    """Jobs/s for `consumers` pgqueuer workers, batch size `batch`, draining `jobs` no-op jobs."""
    from pgqueuer import Queries, QueueManager
    from pgqueuer.domain.types import QueueExecutionMode

    setup = await asyncpg.connect(database_url)
    try:
        queries = Queries.from_asyncpg_connection(setup)
        if await queries.schema_is_installed():
            await queries.uninstall()
        await queries.install()
        for start in range(0, jobs, JOBS_PER_ENQUEUE):
            count = min(JOBS_PER_ENQUEUE, jobs - start)
            await queries.enqueue(["bench"] * count, [None] * count, [0] * count)
    finally:
        await setup.close()

    connections = [await asyncpg.connect(database_url) for _ in range(consumers)]
    managers = [QueueManager(Queries.from_asyncpg_connection(c)) for c in connections]
    for manager in managers:

        @manager.entrypoint("bench")
        async def work(job: object) -> None:
            return None

    began = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                manager.run(
                    dequeue_timeout=timedelta(seconds=1),
                    batch_size=batch,
                    mode=QueueExecutionMode.drain,
                    log_aggregation_interval=timedelta(0),
                )
                for manager in managers
            )
        )
        elapsed = time.perf_counter() - began
    finally:
        for connection in connections:
            if not connection.is_closed():
                await connection.close()
    check = await asyncpg.connect(database_url)
    try:
        left = await check.fetchval("SELECT count(*) FROM pgqueuer")
    finally:
        await check.close()
    if left:
        raise RuntimeError(f"pgqueuer left {left} jobs in the queue")
    return jobs / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=5000)
    parser.add_argument("--consumers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    with scratch_database() as url:
        rate = asyncio.run(pgqueuer_rate(url, args.jobs, args.consumers, args.batch))
    print(f"pgqueuer: {rate:,.0f} jobs/s (N={args.jobs}, {args.consumers} consumers, batch {args.batch})")


if __name__ == "__main__":
    main()
