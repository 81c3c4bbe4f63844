"""PostgreSQL stopped with `-m immediate` mid-flight and started again: a server this test owns.

The engine answers UNAVAILABLE while its database is away; workers keep the model turns and tool
results they have and journal them once it is back: every instance finishes with one ticket and no
model turn is paid twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fault_stack import (
    INSTANCES,
    WORKERS,
    judge,
    running_stack,
    start_instances,
    wait_for,
    wait_until_finished,
)
from owned_postgres import OwnedPostgres, owned_postgres

OUTAGE_SECONDS = 2.0
DRILL = "postgres-restart"


@pytest.fixture
def postgres() -> Iterator[OwnedPostgres]:
    with owned_postgres() as server:
        yield server


async def test_postgres_restarted_mid_flight_loses_no_model_turn(tmp_path, postgres, crm, gemini_url):
    async with running_stack(tmp_path, postgres.url, crm, gemini_url) as stack:
        before = len(crm.tickets())
        async with stack.engine.channel() as channel:
            ids = await start_instances(channel, DRILL, INSTANCES)
        for index in range(WORKERS):
            stack.add_worker(f"w{index}")
        await wait_for(
            lambda: len(crm.tickets()) - before >= INSTANCES // 3, "a third of the tickets", 90, 0.02
        )

        await asyncio.to_thread(postgres.stop_immediately)
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage itself
        await asyncio.to_thread(postgres.start)

        channel = stack.engine.channel()
        try:
            stuck = await wait_until_finished(lambda: channel, ids, timeout=120)
        finally:
            await channel.close()
        outcome = judge(crm, gemini_url, DRILL, ids, stuck)
        print(f"\nfault {DRILL}: {outcome.summary()}")
        assert not stuck, stack.logs()
        outcome.assert_clean()
