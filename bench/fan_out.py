"""One instance fanning out to N service-task items, beside N separate one-node instances, both
completed by the same K SDK workers (`abada_sdk.Worker`) in the same run on the same engine.

(a) N one-node instances started first, then completed by the workers: task cycles/s;
(b) one instance whose service node has `for_each` over N items (`max_concurrency` M), started first
    too, then completed by the same workers: items/s, and (b)/(a) against the target (>= 0.8);
(c) each item's completion as the worker sees it (its Complete / CompleteTasks call): the last item's,
    the one that ends the fan-out and moves the token on, against the p99 of (a)'s single completions
    (target <= 1.5x: the join's cost does not grow with the item count).

    python bench/fan_out.py --items 10000 --workers 8 --concurrency 8 --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from abada.engine.v1 import external_task_pb2
from abada_sdk import AsyncEngineClient, Worker
from common import EngineProcess, engine_process, median, percentile, scratch_database

SINGLE_TOPIC = "cycle"
ITEM_TOPIC = "item"


def bundle(items: int, max_concurrency: int) -> str:
    return f"""
processes:
  - id: single
    start: work
    nodes:
      - {{ id: work, type: service, topic: {SINGLE_TOPIC}, next: done }}
      - {{ id: done, type: end }}
  - id: fanned
    start: work
    nodes:
      - id: work
        type: service
        topic: {ITEM_TOPIC}
        for_each: ${{lines}}
        as: line
        inputs: {{ line: "${{line}}" }}
        max_concurrency: {max_concurrency}
        max_items: {items}
        result_variable: out
        collect: results
        next: done
      - {{ id: done, type: end }}
"""


@dataclass
class Completions:
    """When each task's completion was answered, and how long its call took, as the workers saw it."""

    latency: dict[str, float] = field(default_factory=dict)
    answered_at: dict[str, float] = field(default_factory=dict)
    all_done: asyncio.Event = field(default_factory=asyncio.Event)
    expected: int = 0

    def record(self, task_ids: list[str], began: float, ended: float) -> None:
        for task_id in task_ids:
            self.latency[task_id] = ended - began
            self.answered_at[task_id] = ended
        if len(self.latency) >= self.expected:
            self.all_done.set()

    def last(self) -> str:
        return max(self.answered_at, key=lambda task_id: self.answered_at[task_id])

    def last_answered(self, count: int) -> list[float]:
        """The latencies of the `count` completions answered last."""
        order = sorted(self.answered_at, key=lambda task_id: self.answered_at[task_id])
        return [self.latency[task_id] for task_id in order[-count:]]


class TimedClient(AsyncEngineClient):
    """The SDK's client, timing the calls that complete tasks (Complete alone, CompleteTasks batched)."""

    def __init__(self, completions: Completions, address: str, token: str) -> None:
        super().__init__(address, token=token, timeout=60.0)
        self._completions = completions

    async def call(
        self,
        method: Callable[[], grpc.aio.UnaryUnaryMultiCallable[Any, Any]],
        request: Any,
        timeout: float | None = None,
    ) -> Any:
        if isinstance(request, external_task_pb2.CompleteTasksRequest):
            ids = [completion.task_id for completion in request.completions]
        elif isinstance(request, external_task_pb2.CompleteRequest):
            ids = [request.task_id]
        else:
            return await super().call(method, request, timeout)
        began = time.perf_counter()
        reply = await super().call(method, request, timeout)
        if isinstance(reply, external_task_pb2.CompleteTasksResponse):
            ids = [i for i, r in zip(ids, reply.results, strict=True) if r.HasField("completed")]
        self._completions.record(ids, began, time.perf_counter())
        return reply


async def _echo(task: Any) -> dict[str, Any]:
    return {"out": task.variables.get("line", task.id)}


async def serve_until_done(
    engine: EngineProcess, topic: str, workers: int, concurrency: int, completions: Completions
) -> None:
    pool = []
    for index in range(workers):
        worker = Worker(
            worker_id=f"bench-{index}",
            concurrency=concurrency,
            poll_wait_ms=1_000,
            drain_seconds=5.0,
            client=TimedClient(completions, engine.address, engine.token),
        )
        worker.add_handler(topic, _echo, lease_ms=60_000)
        pool.append(worker)
    serving = [asyncio.create_task(worker.serve(handle_signals=False)) for worker in pool]
    try:
        await completions.all_done.wait()
    finally:
        for worker in pool:
            worker.stop()
        await asyncio.gather(*serving, return_exceptions=True)


async def separate_instances(
    engine: EngineProcess, client: AsyncEngineClient, count: int, workers: int, concurrency: int
) -> dict[str, Any]:
    starts = iter(range(count))

    async def starter() -> None:
        for _ in starts:
            await client.start("single")

    await asyncio.gather(*(starter() for _ in range(8)))
    completions = Completions(expected=count)
    begun = time.perf_counter()
    await serve_until_done(engine, SINGLE_TOPIC, workers, concurrency, completions)
    elapsed = max(completions.answered_at.values()) - begun
    return {"rate": count / elapsed, "elapsed": elapsed, "latency": list(completions.latency.values())}


async def one_fan_out(
    engine: EngineProcess,
    client: AsyncEngineClient,
    count: int,
    workers: int,
    concurrency: int,
    max_concurrency: int,
) -> dict[str, Any]:
    # As the separate instances are all started before their workers begin, so is the fan-out: the
    # clock runs from the workers' start to the last completion in both.
    started_at = time.perf_counter()
    handle = await client.start("fanned", {"lines": [f"line {n}" for n in range(count)]})
    start_seconds = time.perf_counter() - started_at
    completions = Completions(expected=count)
    begun = time.perf_counter()
    await serve_until_done(engine, ITEM_TOPIC, workers, concurrency, completions)
    elapsed = max(completions.answered_at.values()) - begun
    finished = await client.wait(handle.id, timeout=120)  # type: ignore[union-attr]
    results = finished.variables.get("results")
    if results != [f"line {n}" for n in range(count)]:
        raise RuntimeError(f"collect is not every item's result in order: {str(results)[:200]}")
    last = completions.last()
    latencies = list(completions.latency.values())
    return {
        "rate": count / elapsed,
        "elapsed": elapsed,
        "latency": latencies,
        "last": completions.latency[last],
        "start_seconds": start_seconds,
        # The last max_concurrency items' ends are the ones that ask whether the fan-out is over.
        "last_round_p99": percentile(completions.last_answered(max_concurrency), 0.99),
    }


def measure(items: int, workers: int, concurrency: int, max_concurrency: int) -> dict[str, float]:
    with scratch_database() as url, engine_process(url) as engine:

        async def run() -> dict[str, float]:
            async with AsyncEngineClient(engine.address, token=engine.token, timeout=60.0) as client:
                await client.deploy(bundle(items, max_concurrency), source_name="fan_out.yaml")
                single = await separate_instances(engine, client, items, workers, concurrency)
                fanned = await one_fan_out(engine, client, items, workers, concurrency, max_concurrency)
            single_p99 = percentile(single["latency"], 0.99)
            return {
                "single_rate": single["rate"],
                "single_elapsed": single["elapsed"],
                "single_p50": percentile(single["latency"], 0.5),
                "single_p99": single_p99,
                "fan_out_rate": fanned["rate"],
                "fan_out_elapsed": fanned["elapsed"],
                "fan_out_start": fanned["start_seconds"],
                "item_p50": percentile(fanned["latency"], 0.5),
                "item_p99": percentile(fanned["latency"], 0.99),
                "last": fanned["last"],
                "last_round_p99": fanned["last_round_p99"],
                "ratio": fanned["rate"] / single["rate"],
                "join_ratio": fanned["last"] / single_p99,
            }

        return asyncio.run(run())


def report(
    figures: dict[str, float], items: int, workers: int, concurrency: int, max_concurrency: int
) -> None:
    ms = 1000
    print(
        f"separate instances:        {figures['single_rate']:,.0f} task cycles/s (N={items}, K={workers} SDK "
        f"workers x {concurrency}, {figures['single_elapsed']:.2f} s); completion p50 / p99 "
        f"{figures['single_p50'] * ms:.2f} / {figures['single_p99'] * ms:.2f} ms"
    )
    print(
        f"one fan-out:               {figures['fan_out_rate']:,.0f} items/s (N={items}, max_concurrency "
        f"{max_concurrency}, {figures['fan_out_elapsed']:.2f} s, after a {figures['fan_out_start']:.2f} s "
        "StartInstance); completion p50 / p99 "
        f"{figures['item_p50'] * ms:.2f} / {figures['item_p99'] * ms:.2f} ms"
    )
    print(f"fan-out / separate:        {figures['ratio']:.2f}x  (target >= 0.8x)")
    print(
        f"last item's completion:    {figures['last'] * ms:.2f} ms vs single p99 {figures['single_p99'] * ms:.2f} ms"
        f" = {figures['join_ratio']:.2f}x  (target <= 1.5x); the last {max_concurrency} items' p99 "
        f"{figures['last_round_p99'] * ms:.2f} ms"
    )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8, help="tasks each SDK worker runs at once")
    parser.add_argument("--max-concurrency", type=int, default=64, help="the node's max_concurrency")
    parser.add_argument("--runs", type=int, default=1, help="repeat, and print the medians")
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        runs.append(measure(args.items, args.workers, args.concurrency, args.max_concurrency))
        report(runs[-1], args.items, args.workers, args.concurrency, args.max_concurrency)
    if args.runs > 1:
        print(
            f"median over {args.runs} runs: fan-out / separate {median([r['ratio'] for r in runs]):.2f}x, "
            f"last item / single p99 {median([r['join_ratio'] for r in runs]):.2f}x"
        )


if __name__ == "__main__":
    main()
