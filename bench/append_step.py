"""AppendStep calls per second: 8 concurrent tasks journal STARTED+COMPLETED pairs through gRPC.

Prints AppendStep calls/s with p50/p99 and, measured in the same run, the same engine's bare gRPC
rate (health Check at 8 callers: what gRPC alone allows) with the ratio of the two, and the raw
single-row commit rate of the same PostgreSQL. Then the same 8 tasks journaled the way the agent
worker journals them: through its engine client, which sends the steps its tasks journal at the same
moment together in one AppendSteps.

    python bench/append_step.py --tasks 8 --pairs 250
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import grpc
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from abada_sdk.connection import BearerToken
from abada_worker.engine_client import EngineClient
from common import (
    EngineProcess,
    bare_grpc_rate,
    engine_process,
    median,
    percentile,
    raw_commit_rate,
    scratch_database,
)
from google.protobuf import struct_pb2

# An agent node without tools journals only model calls; limits are set out of the way.
BUNDLE = """
processes:
  - id: bench
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-bench-model
        prompt: think
        result_variable: answer
        limits: { max_model_calls: 100000, max_tool_calls: 0, max_tokens: 1000000000 }
        next: done
      - { id: done, type: end }
"""


def _struct(value: dict) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


async def run(engine: EngineProcess, tasks: int, pairs: int, batched: bool = False) -> dict[str, object]:
    """`batched`: the steps go through the agent worker's engine client (one worker, 8 tasks)."""
    async with engine.channel() as channel, grpc.aio.insecure_channel(engine.address) as plain:
        await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
            definition_pb2.DeployRequest(source_name="bench.yaml", content=BUNDLE)
        )
        processes = process_pb2_grpc.ProcessServiceStub(channel)
        for _ in range(tasks):
            await processes.StartInstance(process_pb2.StartInstanceRequest(process_id="bench"))
        stub = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
        locked = (
            await stub.FetchAndLock(
                external_task_pb2.FetchAndLockRequest(
                    worker_id="bench",
                    max_tasks=tasks,
                    topics=[external_task_pb2.TopicSubscription(name="abada:agent", lease_ms=600_000)],
                )
            )
        ).tasks
        latencies: list[float] = []
        send = (
            EngineClient(plain, "bench", BearerToken(engine.token)).append_step
            if batched
            else stub.AppendStep
        )
        request_body = _struct({"turn": 0, "model": "bench-model", "contents": "x" * 200})
        response_body = _struct({"text": "y" * 300, "finishReason": "STOP"})

        async def journal(task: external_task_pb2.ExternalTask) -> None:
            for sequence in range(1, pairs + 1):
                for state, extra in (
                    (external_task_pb2.STEP_STATE_STARTED, {"request": request_body}),
                    (
                        external_task_pb2.STEP_STATE_COMPLETED,
                        {
                            "response": response_body,
                            "tokens": external_task_pb2.TokenUsage(input_tokens=50, output_tokens=20),
                        },
                    ),
                ):
                    began = time.perf_counter()
                    await send(
                        external_task_pb2.AppendStepRequest(
                            task_id=task.id,
                            worker_id="bench",
                            lease_token=task.lease_token,
                            attempt=task.attempt,
                            sequence=sequence,
                            kind=external_task_pb2.STEP_KIND_MODEL_CALL,
                            state=state,
                            **extra,
                        )
                    )
                    latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        await asyncio.gather(*(journal(t) for t in locked))
        elapsed = time.perf_counter() - began
    return {"calls": len(latencies), "elapsed": elapsed, "latencies": latencies}


def measure(tasks: int, pairs: int) -> dict[str, float]:
    with scratch_database() as url, engine_process(url) as engine:
        cpu = engine.cpu_seconds()
        floor_before = asyncio.run(bare_grpc_rate(engine.address))
        cpu_bare = engine.cpu_seconds() - cpu
        cpu = engine.cpu_seconds()
        result = asyncio.run(run(engine, tasks, pairs))
        cpu_append = engine.cpu_seconds() - cpu
        cpu = engine.cpu_seconds()
        batched = asyncio.run(run(engine, tasks, pairs, batched=True))
        cpu_batched = engine.cpu_seconds() - cpu
        floor_after = asyncio.run(bare_grpc_rate(engine.address))
        raw = asyncio.run(raw_commit_rate(url, connections=8))
    rate = result["calls"] / result["elapsed"]
    # The bare rate is taken on both sides of the run, so a change of load on the machine shows.
    floor = (floor_before + floor_after) / 2
    return {
        "rate": rate,
        "calls": result["calls"],
        "elapsed": result["elapsed"],
        "p50": percentile(result["latencies"], 0.5),
        "p99": percentile(result["latencies"], 0.99),
        "bare_grpc": floor,
        "bare_grpc_before": floor_before,
        "bare_grpc_after": floor_after,
        "raw": raw,
        "ratio": rate / floor,
        "cpu_per_append": cpu_append / result["calls"],
        "batched_rate": batched["calls"] / batched["elapsed"],
        "batched_ratio": batched["calls"] / batched["elapsed"] / floor,
        "batched_p50": percentile(batched["latencies"], 0.5),
        "cpu_per_batched_step": cpu_batched / batched["calls"],
        "cpu_per_bare": cpu_bare / 4000,
    }


def report(figures: dict[str, float], tasks: int) -> None:
    print(
        f"AppendStep:                {figures['rate']:,.0f} calls/s ({figures['calls']:.0f} calls, "
        f"{tasks} concurrent tasks, {figures['elapsed']:.2f} s)"
    )
    print(f"AppendStep p50 / p99:      {figures['p50'] * 1000:.2f} / {figures['p99'] * 1000:.2f} ms")
    print(
        f"bare gRPC unary calls:     {figures['bare_grpc']:,.0f}/s at 8 callers (health Check, same engine; "
        f"{figures['bare_grpc_before']:,.0f} before, {figures['bare_grpc_after']:,.0f} after)"
    )
    print(f"AppendStep / bare gRPC:    {figures['ratio']:.2f}  (target >= 0.5)")
    print(
        f"engine CPU per call:       {figures['cpu_per_append'] * 1e6:,.0f} us per AppendStep "
        f"(includes the run's set-up), {figures['cpu_per_bare'] * 1e6:,.0f} us per bare call"
    )
    print(
        f"steps via the agent worker: {figures['batched_rate']:,.0f} steps/s (AppendSteps for steps that meet; "
        f"p50 {figures['batched_p50'] * 1000:.2f} ms, engine CPU {figures['cpu_per_batched_step'] * 1e6:,.0f} us a step)"
    )
    print(f"  worker steps / bare gRPC: {figures['batched_ratio']:.2f}")
    print(f"raw single-row commits:    {figures['raw']:,.0f}/s at 8 connections (same PostgreSQL, same run)")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1, help="repeat, and print the median ratio")
    args = parser.parse_args()
    ratios, batched_ratios = [], []
    for _ in range(args.runs):
        figures = measure(args.tasks, args.pairs)
        report(figures, args.tasks)
        ratios.append(figures["ratio"])
        batched_ratios.append(figures["batched_ratio"])
    if args.runs > 1:
        print(f"median AppendStep / bare gRPC over {args.runs} runs: {median(ratios):.2f}")
        print(f"median worker steps / bare gRPC over {args.runs} runs: {median(batched_ratios):.2f}")


if __name__ == "__main__":
    main()
