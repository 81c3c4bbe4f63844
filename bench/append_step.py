"""AppendStep calls per second: 8 concurrent tasks journal STARTED+COMPLETED pairs through gRPC.

Prints AppendStep calls/s with p50/p99, and the raw single-row commit rate of the same PostgreSQL
measured in the same run, with the ratio of the two.

    python bench/append_step.py --tasks 8 --pairs 250
"""

from __future__ import annotations

import argparse
import asyncio
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
from google.protobuf import struct_pb2

# An agent node without tools journals only model calls; limits are set out of the way.
BUNDLE = """
processes:
  - id: bench
    start: agent
    nodes:
      - id: agent
        type: agent
        model: bench-model
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


async def run(engine: EngineProcess, tasks: int, pairs: int) -> dict[str, object]:
    async with engine.channel() as channel:
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
                    await stub.AppendStep(
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=200)
    args = parser.parse_args()
    with scratch_database() as url, engine_process(url) as engine:
        result = asyncio.run(run(engine, args.tasks, args.pairs))
        raw = asyncio.run(raw_commit_rate(url, connections=8))
        floor = asyncio.run(bare_grpc_rate(engine.address))
    rate = result["calls"] / result["elapsed"]
    print(
        f"AppendStep:                {rate:,.0f} calls/s ({result['calls']} calls, {args.tasks} concurrent tasks, "
        f"{result['elapsed']:.2f} s)"
    )
    print(
        f"AppendStep p50 / p99:      {percentile(result['latencies'], 0.5) * 1000:.2f} / "
        f"{percentile(result['latencies'], 0.99) * 1000:.2f} ms"
    )
    print(f"raw single-row commits:    {raw:,.0f}/s at 8 connections (same PostgreSQL, same run)")
    print(f"AppendStep / raw commits:  {rate / raw:.3f}")
    print(f"bare gRPC unary calls:     {floor:,.0f}/s at 8 callers (health Check, same engine, same run)")
    print("target: >= 3,800 AppendStep calls/s at 8 concurrent tasks")


if __name__ == "__main__":
    main()
