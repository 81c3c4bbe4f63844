"""100,000 timers due within one minute on 2 engine replicas: how late they fire, and what their firing
costs the queue beside them.

Two engine processes share one database (and their keys, as in a deployment). The timers are set by
StartInstance calls through both replicas, each instance a `timer` node whose `until` is its own due
time, spread evenly over a one-minute window that opens once every start is in. Meanwhile a few
workers keep fetching and completing service tasks (FetchAndLock, one task a call) on both replicas:
their FetchAndLock latency while the timers fire is compared with the same loop after the window,
when nothing fires, for as long (the peer figure, same run, same replicas). Lateness is read from the database:
each timer's fire time minus its due time, both by the database's clock.

Targets: p99 lateness <= 1 s; FetchAndLock p99 while firing <= 1.5x its p99 without.

    python bench/timers.py --timers 100000 --window 60
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import secrets
import time
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from common import EngineProcess, engine_process, percentile, scratch_database
from google.protobuf import struct_pb2

BUNDLE = """
processes:
  - id: pause
    start: wait
    nodes:
      - { id: wait, type: timer, until: "${at}", next: done }
      - { id: done, type: end }
  - id: work
    start: step
    nodes:
      - { id: step, type: service, topic: bench-work, next: again }
      - id: again
        type: exclusive
        branches: [{ when: "stop == true", next: done }]
        default: step
      - { id: done, type: end }
"""
# Concurrent StartInstance callers per replica, and the fetch-and-complete loops beside the timers.
STARTERS = 16
FETCHERS = 4
# A fetcher's pause between two cycles: a steady queue, not a saturated one.
FETCH_PAUSE_SECONDS = 0.02
# The window opens this long after the starts are estimated to be in (calibrated on the first ones).
MARGIN_SECONDS = 5.0


def _struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


async def _set_timers(replicas: list[EngineProcess], count: int, window: float) -> tuple[datetime, float]:
    """Start `count` instances whose timers fall evenly in a `window`-second window; when it opens and
    how long the starts took."""
    channels = [replica.channel() for replica in replicas]
    stubs = [process_pb2_grpc.ProcessServiceStub(channel) for channel in channels]
    try:
        # Calibrate: how fast starts go here, so the window opens just after the last one is in.
        probe = min(2000, count)
        began = time.perf_counter()
        await _start_many(stubs, [{"at": "2999-01-01T00:00:00Z"}] * probe)
        rate = probe / (time.perf_counter() - began)
        lead = count / rate * 1.3 + MARGIN_SECONDS
        opens = datetime.now(UTC) + timedelta(seconds=lead)
        print(f"  starts at {rate:,.0f}/s: the window opens in {lead:.0f} s")
        began = time.perf_counter()
        dues = [{"at": (opens + timedelta(seconds=window * n / count)).isoformat()} for n in range(count)]
        await _start_many(stubs, dues)
        return opens, time.perf_counter() - began
    finally:
        for channel in channels:
            await channel.close()


async def _start_many(
    stubs: list[process_pb2_grpc.ProcessServiceStub], variables: list[dict[str, str]]
) -> None:
    queue = list(enumerate(variables))

    async def starter(stub: process_pb2_grpc.ProcessServiceStub) -> None:
        while queue:
            _, values = queue.pop()
            await stub.StartInstance(
                process_pb2.StartInstanceRequest(process_id="pause", variables=_struct(values)), timeout=60
            )

    await asyncio.gather(*(starter(stub) for stub in stubs for _ in range(STARTERS)))


async def _fetch_loops(
    replicas: list[EngineProcess], until: float, samples: list[tuple[float, float]]
) -> None:
    """FETCHERS loops, alternating replicas, each cycling its own `work` instance until `until`
    (time.monotonic()); every FetchAndLock's (start, seconds) lands in `samples`."""
    channels = [replica.channel() for replica in replicas]
    try:

        async def loop(index: int) -> None:
            channel = channels[index % len(channels)]
            tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
            worker = f"bench-fetcher-{index}"
            while time.monotonic() < until:
                began = time.monotonic()
                locked = (
                    await tasks.FetchAndLock(
                        external_task_pb2.FetchAndLockRequest(
                            worker_id=worker,
                            max_tasks=1,
                            topics=[external_task_pb2.TopicSubscription(name="bench-work", lease_ms=60_000)],
                        )
                    )
                ).tasks
                samples.append((began, time.monotonic() - began))
                for task in locked:
                    await tasks.Complete(
                        external_task_pb2.CompleteRequest(
                            task_id=task.id,
                            worker_id=worker,
                            lease_token=task.lease_token,
                            variables=_struct({}),
                        )
                    )
                await asyncio.sleep(FETCH_PAUSE_SECONDS)

        await asyncio.gather(*(loop(i) for i in range(FETCHERS)))
    finally:
        for channel in channels:
            await channel.close()


async def _lateness(url: str) -> tuple[list[float], int, int]:
    """Each fired timer's lateness (s), how many timers there are, and how many fired more than once."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT EXTRACT(EPOCH FROM fired_at - due_at) AS late FROM timers "
            "WHERE fired_at IS NOT NULL AND due_at < '2999-01-01'"
        )
        total = await conn.fetchval("SELECT count(*) FROM timers WHERE due_at < '2999-01-01'")
        twice = await conn.fetchval(
            "SELECT count(*) FROM (SELECT instance_id FROM history WHERE type = 'TIMER_FIRED' "
            "GROUP BY instance_id HAVING count(*) > 1) AS more"
        )
        return [float(r["late"]) for r in rows], int(total), int(twice)
    finally:
        await conn.close()


async def run(url: str, replicas: list[EngineProcess], count: int, window: float) -> dict[str, float]:
    async with replicas[0].channel() as channel:
        await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
            definition_pb2.DeployRequest(source_name="timers.yaml", content=BUNDLE)
        )
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        for _ in range(FETCHERS):
            await processes.StartInstance(
                process_pb2.StartInstanceRequest(process_id="work", variables=_struct({"stop": False}))
            )
    opens, start_seconds = await _set_timers(replicas, count, window)
    samples: list[tuple[float, float]] = []
    # Firing: the window, and a little after for the last ones; then the same loop with nothing due.
    wait = max(0.0, (opens - datetime.now(UTC)).total_seconds())
    firing_from = time.monotonic() + wait
    firing_to = firing_from + window + 1.0
    # The peer runs as long as the firing window: a p99 of each from as many calls.
    calm_seconds = window + 1.0
    await _fetch_loops(replicas, firing_to + calm_seconds, samples)
    late, total, twice = await _lateness(url)
    firing = [s for at, s in samples if firing_from <= at < firing_to]
    calm = [s for at, s in samples if at >= firing_to]
    return {
        "timers": total,
        "fired": len(late),
        "fired_twice": twice,
        "start_seconds": start_seconds,
        "late_p50": percentile(late, 0.5),
        "late_p99": percentile(late, 0.99),
        "late_max": max(late) if late else float("nan"),
        "fetch_p50": percentile(firing, 0.5),
        "fetch_p99": percentile(firing, 0.99),
        "peer_fetch_p50": percentile(calm, 0.5),
        "peer_fetch_p99": percentile(calm, 0.99),
        "fetch_ratio": percentile(firing, 0.99) / percentile(calm, 0.99),
        "fetches": len(firing),
        "peer_fetches": len(calm),
    }


def measure(count: int = 100_000, window: float = 60.0) -> dict[str, float]:
    shared = {
        "ABADA_JOURNAL_KEYS": "bench:" + base64.b64encode(os.urandom(32)).decode(),
        "ABADA_IDEMPOTENCY_SECRET": secrets.token_urlsafe(32),
    }
    with scratch_database() as url, ExitStack() as stack:
        first = stack.enter_context(engine_process(url, shared))
        second = stack.enter_context(engine_process(url, shared))  # after the first migrated
        return asyncio.run(run(url, [first, second], count, window))


def report(result: dict[str, float], count: int, window: float) -> None:
    print(
        f"timers, 2 replicas: {result['fired']:,.0f} of {result['timers']:,.0f} fired "
        f"({result['fired_twice']:.0f} twice), due within {window:.0f} s (set in {result['start_seconds']:.0f} s); "
        f"lateness p50 {result['late_p50'] * 1000:.0f} ms, p99 {result['late_p99'] * 1000:.0f} ms, "
        f"max {result['late_max'] * 1000:.0f} ms"
    )
    print(
        f"  FetchAndLock while they fire: p50 {result['fetch_p50'] * 1000:.2f} ms, p99 {result['fetch_p99'] * 1000:.2f} ms "
        f"({result['fetches']:.0f} calls); without: p50 {result['peer_fetch_p50'] * 1000:.2f} ms, "
        f"p99 {result['peer_fetch_p99'] * 1000:.2f} ms ({result['peer_fetches']:.0f}) = {result['fetch_ratio']:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--timers", type=int, default=100_000)
    parser.add_argument("--window", type=float, default=60.0)
    args = parser.parse_args()
    report(measure(args.timers, args.window), args.timers, args.window)


if __name__ == "__main__":
    main()
