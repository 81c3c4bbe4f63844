"""Task cycles per second: K workers fetch-and-lock and complete N one-node instances through gRPC.

Prints tasks/s, p50/p99 of FetchAndLock and Complete, and the raw single-row commit rate of the
same PostgreSQL measured in the same run, with the ratio of the two.

    python bench/task_cycle.py --instances 5000 --workers 8 --batch 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from common import (
    EngineProcess,
    bare_grpc_rate,
    engine_process,
    percentile,
    raw_commit_rate,
    scratch_database,
)

BUNDLE = """
processes:
  - id: bench
    start: work
    nodes:
      - { id: work, type: service, topic: bench, next: done }
      - { id: done, type: end }
"""


async def create_instances(engine: EngineProcess, count: int) -> float:
    async with engine.channel() as channel:
        definitions = definition_pb2_grpc.DefinitionServiceStub(channel)
        await definitions.Deploy(definition_pb2.DeployRequest(source_name="bench.yaml", content=BUNDLE))
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        begun = time.perf_counter()
        queue = iter(range(count))

        async def starter() -> None:
            for _ in queue:
                await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="bench"))

        await asyncio.gather(*(starter() for _ in range(8)))
        return count / (time.perf_counter() - begun)


async def run_workers(engine: EngineProcess, total: int, workers: int, batch: int) -> dict[str, object]:
    fetch_latency: list[float] = []
    complete_latency: list[float] = []
    done = 0
    channels = [engine.channel() for _ in range(workers)]

    async def worker(index: int) -> None:
        nonlocal done
        stub = external_task_pb2_grpc.ExternalTaskServiceStub(channels[index])
        request = external_task_pb2.FetchAndLockRequest(
            worker_id=f"bench-{index}",
            max_tasks=batch,
            wait_ms=0,
            topics=[external_task_pb2.TopicSubscription(name="bench", lease_ms=60_000)],
        )
        while done < total:
            t0 = time.perf_counter()
            tasks = (await stub.FetchAndLock(request)).tasks
            fetch_latency.append(time.perf_counter() - t0)
            if not tasks:
                if done >= total:
                    return
                await asyncio.sleep(0.001)
                continue

            async def finish(task: external_task_pb2.ExternalTask) -> None:
                t1 = time.perf_counter()
                await stub.Complete(
                    external_task_pb2.CompleteRequest(
                        task_id=task.id, worker_id=f"bench-{index}", lease_token=task.lease_token
                    )
                )
                complete_latency.append(time.perf_counter() - t1)

            # A worker runs its fetched batch concurrently, as a real worker with free slots does.
            await asyncio.gather(*(finish(t) for t in tasks))
            done += len(tasks)

    begun = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    elapsed = time.perf_counter() - begun
    for channel in channels:
        await channel.close()
    return {"elapsed": elapsed, "rate": total / elapsed, "fetch": fetch_latency, "complete": complete_latency}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    with scratch_database() as url, engine_process(url) as engine:
        start_rate = asyncio.run(create_instances(engine, args.instances))
        result = asyncio.run(run_workers(engine, args.instances, args.workers, args.batch))
        raw = asyncio.run(raw_commit_rate(url, connections=8))
        floor = asyncio.run(bare_grpc_rate(engine.address))
    ms = 1000
    print(f"instances started:         {args.instances} at {start_rate:,.0f}/s")
    print(
        f"task cycles:               {result['rate']:,.0f}/s  (N={args.instances}, K={args.workers}, "
        f"max_tasks={args.batch}, {result['elapsed']:.2f} s)"
    )
    print(
        f"FetchAndLock p50 / p99:    {percentile(result['fetch'], 0.5) * ms:.2f} / "
        f"{percentile(result['fetch'], 0.99) * ms:.2f} ms"
    )
    print(
        f"Complete p50 / p99:        {percentile(result['complete'], 0.5) * ms:.2f} / "
        f"{percentile(result['complete'], 0.99) * ms:.2f} ms"
    )
    print(f"raw single-row commits:    {raw:,.0f}/s at 8 connections (same PostgreSQL, same run)")
    print(f"task cycles / raw commits: {result['rate'] / raw:.3f}")
    print(f"bare gRPC unary calls:     {floor:,.0f}/s at 8 callers (health Check, same engine, same run)")
    print("target: >= 2,900 task cycles/s at K=8")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
