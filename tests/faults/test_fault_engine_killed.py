"""The engine SIGKILLed mid-flight and started again 3 s later, on the same address.

Workers whose model turns and tool calls return while the engine is gone keep them and journal them
once it is back (the lease is re-granted when it ran out with nobody taking over): every instance
finishes with exactly one ticket, and no model turn is paid twice.
"""

from __future__ import annotations

import asyncio

from fault_stack import (
    INSTANCES,
    WORKERS,
    judge,
    running_stack,
    start_instances,
    wait_for,
    wait_until_finished,
)

OUTAGE_SECONDS = 3.0
DRILL = "engine-sigkill"


async def test_engine_sigkilled_after_a_third_of_the_writes_loses_no_model_turn(
    tmp_path, shared_database, crm, gemini_url
):
    async with running_stack(tmp_path, shared_database, crm, gemini_url) as stack:
        before = len(crm.tickets())
        async with stack.engine.channel() as channel:
            ids = await start_instances(channel, DRILL, INSTANCES)
        for index in range(WORKERS):
            stack.add_worker(f"w{index}")
        await wait_for(
            lambda: len(crm.tickets()) - before >= INSTANCES // 3, "a third of the tickets", 90, 0.02
        )

        stack.engine.kill()
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage itself, not a wait for a condition
        await stack.engine.start()

        channel = stack.engine.channel()
        try:
            stuck = await wait_until_finished(lambda: channel, ids, timeout=120)
        finally:
            await channel.close()
        outcome = judge(crm, gemini_url, DRILL, ids, stuck)
        print(f"\nfault {DRILL}: {outcome.summary()}")
        assert not stuck, stack.logs()
        outcome.assert_clean()
