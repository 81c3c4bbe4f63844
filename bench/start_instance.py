"""StartInstance calls per second at 8 callers, against the same engine's bare gRPC rate in the same run.

Two shapes: a process whose start leads straight to a service task (one task and its history are
written per start), and the same behind an exclusive gateway whose condition reads a variable.

    python bench/start_instance.py --starts 4000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from abada.engine.v1 import definition_pb2, definition_pb2_grpc, process_pb2, process_pb2_grpc
from common import EngineProcess, bare_grpc_rate, engine_process, median, percentile, scratch_database
from google.protobuf import struct_pb2

BUNDLE = """
processes:
  - id: plain
    start: work
    nodes:
      - { id: work, type: service, topic: bench, next: done }
      - { id: done, type: end }
  - id: routed
    start: route
    nodes:
      - id: route
        type: exclusive
        branches:
          - { when: "priority == 'high'", next: urgent }
        default: work
      - { id: urgent, type: service, topic: urgent, next: done }
      - { id: work, type: service, topic: bench, next: done }
      - { id: done, type: end }
"""

CALLERS = 8


async def _starts(engine: EngineProcess, process_id: str, count: int) -> tuple[float, list[float]]:
    variables = struct_pb2.Struct()
    variables.update({"customerId": "C-1042", "priority": "normal", "n": 1})
    latencies: list[float] = []
    async with engine.channel() as channel:
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        queue = iter(range(count))

        async def starter() -> None:
            for _ in queue:
                began = time.perf_counter()
                await processes.StartInstance(
                    process_pb2.StartInstanceRequest(process_id=process_id, variables=variables)
                )
                latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        await asyncio.gather(*(starter() for _ in range(CALLERS)))
        return count / (time.perf_counter() - began), latencies


async def run(engine: EngineProcess, count: int) -> dict[str, float]:
    async with engine.channel() as channel:
        await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
            definition_pb2.DeployRequest(source_name="bench.yaml", content=BUNDLE)
        )
    await _starts(engine, "plain", 200)  # warm: prepared statements, pool, caches
    cpu = engine.cpu_seconds()
    bare_before = await bare_grpc_rate(engine.address, CALLERS)
    cpu_bare = engine.cpu_seconds() - cpu
    cpu = engine.cpu_seconds()
    plain, latencies = await _starts(engine, "plain", count)
    cpu_plain = engine.cpu_seconds() - cpu
    routed, _ = await _starts(engine, "routed", count // 2)
    bare_after = await bare_grpc_rate(engine.address, CALLERS)
    bare = (bare_before + bare_after) / 2
    return {
        "rate": plain,
        "routed": routed,
        "p50": percentile(latencies, 0.5),
        "p99": percentile(latencies, 0.99),
        "bare_grpc": bare,
        "ratio": plain / bare,
        "cpu_per_start": cpu_plain / count,
        "cpu_per_bare": cpu_bare / 4000,
    }


def measure(count: int) -> dict[str, float]:
    with scratch_database() as url, engine_process(url) as engine:
        return asyncio.run(run(engine, count))


def report(figures: dict[str, float]) -> None:
    print(f"StartInstance:             {figures['rate']:,.0f}/s at {CALLERS} callers (target >= 1,500/s)")
    print(f"  with a gateway condition {figures['routed']:,.0f}/s")
    print(f"StartInstance p50 / p99:   {figures['p50'] * 1000:.2f} / {figures['p99'] * 1000:.2f} ms")
    print(
        f"bare gRPC unary calls:     {figures['bare_grpc']:,.0f}/s at {CALLERS} callers (same engine, same run)"
    )
    print(f"StartInstance / bare gRPC: {figures['ratio']:.2f}")
    print(
        f"engine CPU per call:       {figures['cpu_per_start'] * 1e6:,.0f} us per StartInstance, "
        f"{figures['cpu_per_bare'] * 1e6:,.0f} us per bare call"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--starts", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    runs = [measure(args.starts) for _ in range(args.runs)]
    for figures in runs:
        report(figures)
    if args.runs > 1:
        print(f"median StartInstance: {median([r['rate'] for r in runs]):,.0f}/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
