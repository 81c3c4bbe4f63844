"""The issue's two outage drills at full size, with real processes: a figure for the report, not a test.

100 instances of Alice's three-turn agent (a read, a keyed write, the answer) on two workers at
concurrency 25, lease 6 s; then, after a third of the writes,

- engine-sigkill: the engine SIGKILLed and started again 3 s later on the same address;
- postgres-restart: PostgreSQL (a server this script owns, never the machine's) stopped with
  `-m immediate` and started again 3 s later.

Each prints instances finished, tickets (one each?), model turns played and re-paid (the scripted
endpoint's ledger), duplicate idempotency keys. The suite runs the same drills smaller (tests/faults).

    python bench/fault_drill.py --instances 100 --workers 2 --concurrency 25
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import sys
import tempfile
import time
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "faults"))

from common import scratch_database  # noqa: E402
from crm_mcp.testing import running_crm_server  # noqa: E402
from fault_stack import (  # noqa: E402
    alice_script,
    judge,
    running_stack,
    start_instances,
    wait_for,
    wait_until_finished,
)
from owned_postgres import owned_postgres  # noqa: E402
from scripted_gemini.testing import running_scripted_gemini  # noqa: E402


@contextlib.contextmanager
def database_for(drill: str) -> Iterator[tuple[str, object | None]]:
    if drill == "postgres-restart":
        with owned_postgres() as server:
            yield server.url, server
    else:
        with scratch_database() as url:
            yield url, None


async def run_drill(drill: str, args: argparse.Namespace, url: str, postgres: object | None) -> str:
    with (
        tempfile.TemporaryDirectory(prefix=f"abada-{drill}-") as state,
        running_crm_server() as crm,
        running_scripted_gemini(alice_script()) as gemini_url,
    ):
        async with running_stack(pathlib.Path(state), url, crm, gemini_url) as stack:
            async with stack.engine.channel() as channel:
                ids = await start_instances(channel, drill, args.instances)
            began = time.monotonic()
            for index in range(args.workers):
                stack.add_worker(f"w{index}", concurrency=args.concurrency, lease_ms=args.lease_ms)
            await wait_for(
                lambda: len(crm.tickets()) >= args.instances // 3, "a third of the tickets", 300, 0.02
            )
            if drill == "engine-sigkill":
                stack.engine.kill()
                await asyncio.sleep(args.outage)
                await stack.engine.start()
            else:
                await asyncio.to_thread(postgres.stop_immediately)  # type: ignore[union-attr]
                await asyncio.sleep(args.outage)
                await asyncio.to_thread(postgres.start)  # type: ignore[union-attr]
            channel = stack.engine.channel()
            try:
                stuck = await wait_until_finished(lambda: channel, ids, timeout=600)
            finally:
                await channel.close()
            elapsed = time.monotonic() - began
            outcome = judge(crm, gemini_url, drill, ids, stuck)
            return f"{drill}: {outcome.summary()} in {elapsed:.1f}s"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=25)
    parser.add_argument("--lease-ms", type=int, default=6_000)
    parser.add_argument(
        "--outage", type=float, default=3.0, help="seconds the engine / PostgreSQL stays down"
    )
    parser.add_argument("--drill", choices=["engine-sigkill", "postgres-restart"], action="append")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for drill in args.drill or ["engine-sigkill", "postgres-restart"]:
        # The database is made outside the drill's event loop (its helper runs a loop of its own).
        with database_for(drill) as (url, postgres):
            print(asyncio.run(run_drill(drill, args, url, postgres)), flush=True)


if __name__ == "__main__":
    main()
