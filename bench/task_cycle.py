"""Task cycles per second: K workers fetch-and-lock and complete N one-node instances through gRPC.

Prints tasks/s, p50/p99 of FetchAndLock and Complete, and in the same run, on the same PostgreSQL:
the peer (pgqueuer draining N no-op jobs with 8 consumers, batch 4) and the ratio of the two, and
the raw single-row commit rate.

    python bench/task_cycle.py --instances 5000 --workers 8 --batch 16
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence

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
    median,
    percentile,
    raw_commit_rate,
    scratch_database,
)
from pgqueuer_peer import pgqueuer_rate

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


async def run_workers(
    engine: EngineProcess, total: int, workers: int, batch: int, eager: bool = False, batched: bool = False
) -> dict[str, object]:
    """K workers, each running its fetched batch concurrently; with `eager`, every Complete asks for
    the worker's next task (fetch_next, max_tasks 1), and FetchAndLock is only called when none came.
    With `batched`, a worker hands its finished batch back in one CompleteTasks call whose answer
    brings the next batch (fetch_next, max_tasks `batch`), as pgqueuer acknowledges its jobs in
    batches; FetchAndLock only when none came."""
    fetch_latency: list[float] = []
    complete_latency: list[float] = []
    done = 0
    channels = [engine.channel() for _ in range(workers)]
    subscription = external_task_pb2.TopicSubscription(name="bench", lease_ms=60_000)

    async def worker(index: int) -> None:
        nonlocal done
        worker_id = f"bench-{index}"
        stub = external_task_pb2_grpc.ExternalTaskServiceStub(channels[index])
        request = external_task_pb2.FetchAndLockRequest(
            worker_id=worker_id, max_tasks=batch, wait_ms=0, topics=[subscription]
        )
        next_one = external_task_pb2.FetchNext(topics=[subscription], max_tasks=1) if eager else None

        async def finish(task: external_task_pb2.ExternalTask | None) -> None:
            nonlocal done
            while task is not None:
                t1 = time.perf_counter()
                answer = await stub.Complete(
                    external_task_pb2.CompleteRequest(
                        task_id=task.id,
                        worker_id=worker_id,
                        lease_token=task.lease_token,
                        fetch_next=next_one,
                    )
                )
                complete_latency.append(time.perf_counter() - t1)
                done += 1
                task = answer.next_tasks[0] if answer.next_tasks else None

        async def finish_all(tasks: Sequence[external_task_pb2.ExternalTask]) -> None:
            nonlocal done
            while tasks:
                t1 = time.perf_counter()
                answer = await stub.CompleteTasks(
                    external_task_pb2.CompleteTasksRequest(
                        worker_id=worker_id,
                        completions=[
                            external_task_pb2.CompleteRequest(task_id=t.id, lease_token=t.lease_token)
                            for t in tasks
                        ],
                        fetch_next=next_batch,
                    )
                )
                complete_latency.append(time.perf_counter() - t1)
                refused = [r.refused for r in answer.results if r.HasField("refused")]
                if refused:
                    raise RuntimeError(f"completions refused: {refused[0].message}")
                done += len(tasks)
                tasks = answer.next_tasks

        next_batch = external_task_pb2.FetchNext(topics=[subscription], max_tasks=batch)
        while done < total:
            t0 = time.perf_counter()
            tasks = (await stub.FetchAndLock(request)).tasks
            fetch_latency.append(time.perf_counter() - t0)
            if not tasks:
                if done >= total:
                    return
                await asyncio.sleep(0.001)
                continue
            if batched:
                await finish_all(tasks)
                continue
            # A worker runs its fetched batch concurrently, as a real worker with free slots does.
            await asyncio.gather(*(finish(t) for t in tasks))

    begun = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(workers)))
    elapsed = time.perf_counter() - begun
    for channel in channels:
        await channel.close()
    return {"elapsed": elapsed, "rate": total / elapsed, "fetch": fetch_latency, "complete": complete_latency}


def measure(
    instances: int,
    workers: int,
    batch: int,
    eager: bool = False,
    peer_consumers: int = 8,
    peer_batch: int = 4,
) -> dict[str, float]:
    """One run: the engine's task cycles completed one Complete a task, then N more completed in
    batches (CompleteTasks), then the peer on the same PostgreSQL."""
    with scratch_database() as url, engine_process(url) as engine:
        start_rate = asyncio.run(create_instances(engine, instances))
        result = asyncio.run(run_workers(engine, instances, workers, batch, eager))
        asyncio.run(create_instances(engine, instances))
        batched = asyncio.run(run_workers(engine, instances, workers, batch, batched=True))
        raw = asyncio.run(raw_commit_rate(url, connections=8))
        floor = asyncio.run(bare_grpc_rate(engine.address))
    with scratch_database() as url:
        peer = asyncio.run(pgqueuer_rate(url, instances, peer_consumers, peer_batch))
    return {
        "start_rate": start_rate,
        "rate": result["rate"],
        "elapsed": result["elapsed"],
        "fetch_p50": percentile(result["fetch"], 0.5),
        "fetch_p99": percentile(result["fetch"], 0.99),
        "complete_p50": percentile(result["complete"], 0.5),
        "complete_p99": percentile(result["complete"], 0.99),
        "raw": raw,
        "bare_grpc": floor,
        "peer": peer,
        "ratio": result["rate"] / peer,
        "eager": float(eager),
        "batched_rate": batched["rate"],
        "batched_ratio": batched["rate"] / peer,
        "batched_complete_p50": percentile(batched["complete"], 0.5),
        "batched_complete_p99": percentile(batched["complete"], 0.99),
    }


def report(figures: dict[str, float], instances: int, workers: int, batch: int) -> None:
    ms = 1000
    print(f"instances started:         {instances} at {figures['start_rate']:,.0f}/s")
    print(
        f"task cycles:               {figures['rate']:,.0f}/s  (N={instances}, K={workers}, "
        f"max_tasks={batch}{', eager dispatch' if figures['eager'] else ''}, {figures['elapsed']:.2f} s)"
    )
    print(f"FetchAndLock p50 / p99:    {figures['fetch_p50'] * ms:.2f} / {figures['fetch_p99'] * ms:.2f} ms")
    print(
        f"Complete p50 / p99:        {figures['complete_p50'] * ms:.2f} / {figures['complete_p99'] * ms:.2f} ms"
    )
    print(
        f"pgqueuer 1.6 (peer):       {figures['peer']:,.0f} jobs/s (N={instances}, 8 consumers, batch 4, same run)"
    )
    print(f"task cycles / pgqueuer:    {figures['ratio']:.2f}  (target >= 1.0)")
    print(
        f"batched task cycles:       {figures['batched_rate']:,.0f}/s  (N={instances} more, K={workers}, "
        f"max_tasks={batch}; each batch back in one CompleteTasks, which brings the next)"
    )
    print(
        f"CompleteTasks p50 / p99:   {figures['batched_complete_p50'] * ms:.2f} / "
        f"{figures['batched_complete_p99'] * ms:.2f} ms  (a batch of up to {batch})"
    )
    print(f"batched / pgqueuer:        {figures['batched_ratio']:.2f}  (target >= 1.0)")
    print(f"raw single-row commits:    {figures['raw']:,.0f}/s at 8 connections (same PostgreSQL, same run)")
    print(
        f"bare gRPC unary calls:     {figures['bare_grpc']:,.0f}/s at 8 callers (health Check, same engine)"
    )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--instances", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--runs", type=int, default=1, help="repeat, and print the median ratio")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="every Complete asks for the next task (fetch_next, max_tasks 1); FetchAndLock only when none came",
    )
    args = parser.parse_args()
    ratios, batched = [], []
    for _ in range(args.runs):
        figures = measure(args.instances, args.workers, args.batch, eager=args.eager)
        report(figures, args.instances, args.workers, args.batch)
        ratios.append(figures["ratio"])
        batched.append(figures["batched_ratio"])
    if args.runs > 1:
        print(
            f"median over {args.runs} runs: task cycles / pgqueuer {median(ratios):.2f}, "
            f"batched / pgqueuer {median(batched):.2f}"
        )


if __name__ == "__main__":
    main()
