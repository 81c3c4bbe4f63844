"""Model calls admitted per second under a quota, by two engine replicas over one database.

Concurrent tasks, spread over two engine processes, each journal model calls: STARTED (the engine
admits the call against the model profile's windows, shared in PostgreSQL) then COMPLETED (its
tokens settle the estimate). The quota is real but set above what the run can reach, so every call
is admitted and the figure is admission's own speed, not the quota's. In the same run, the same
journaling for a model without a profile (no admission) and the bare gRPC rate of one replica. Then
the quota's calls journaled the way agent workers journal them: two workers, one a replica, each
sending the steps its tasks journal at the same moment together (AppendSteps).

    python bench/quota_admission.py --tasks 32 --calls 60
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import asyncpg
import grpc
import profile_engine
import psutil
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from abada_engine.store import model_quotas
from abada_sdk.connection import BearerToken
from abada_worker.engine_client import EngineClient
from common import EngineProcess, bare_grpc_rate, engine_process, percentile, scratch_database
from google.protobuf import struct_pb2

BUNDLE = """
models:
  - name: quota-model
    provider: gemini
    requests_per_minute: 100000000
    tokens_per_minute: 100000000000
    max_concurrent_calls: 1000000
    price: { input_per_million_usd: 0.30, output_per_million_usd: 2.50 }
processes:
  - id: {process}
    start: agent
    nodes:
      - id: agent
        type: agent
        model: {model}
        prompt: think
        result_variable: answer
        limits: {{ max_model_calls: 100000, max_tool_calls: 0, max_tokens: 1000000000 }}
        next: done
      - {{ id: done, type: end }}
"""


def _struct(value: dict) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


async def run(
    replicas: list[EngineProcess],
    process_id: str,
    tasks: int,
    calls: int,
    profile: bool = False,
    through_workers: bool = False,
) -> dict[str, object]:
    """`through_workers`: each task's steps go through the engine client of an agent worker, one worker
    a replica, instead of a call of their own, each to the replica after the last."""
    channels = [replica.channel() for replica in replicas]
    plain = [grpc.aio.insecure_channel(replica.address) for replica in replicas]
    workers = [
        EngineClient(channel, "bench", BearerToken(replica.token))
        for channel, replica in zip(plain, replicas, strict=True)
    ]
    try:
        first = channels[0]
        processes = process_pb2_grpc.ProcessServiceStub(first)
        for _ in range(tasks):
            await processes.StartInstance(process_pb2.StartInstanceRequest(process_id=process_id))
        locked = (
            await external_task_pb2_grpc.ExternalTaskServiceStub(first).FetchAndLock(
                external_task_pb2.FetchAndLockRequest(
                    worker_id="bench",
                    max_tasks=tasks,
                    topics=[external_task_pb2.TopicSubscription(name="abada:agent", lease_ms=600_000)],
                )
            )
        ).tasks
        assert len(locked) == tasks, f"locked {len(locked)} of {tasks}"
        stubs = [external_task_pb2_grpc.ExternalTaskServiceStub(channel) for channel in channels]
        admissions: list[float] = []
        request_body = _struct({"turn": 0, "model": "quota-model"})
        response_body = _struct({"text": "y" * 300, "finishReason": "STOP"})

        async def journal(index: int, task: external_task_pb2.ExternalTask) -> None:
            for sequence in range(1, calls + 1):
                # Each call goes through one replica and the next through the other: the quota is
                # theirs together. A worker's tasks stay with the worker, and its replica.
                if through_workers:
                    send = workers[index % len(workers)].append_step
                else:
                    send = stubs[(index + sequence) % len(stubs)].AppendStep
                common = {
                    "task_id": task.id,
                    "worker_id": "bench",
                    "lease_token": task.lease_token,
                    "attempt": task.attempt,
                    "sequence": sequence,
                    "kind": external_task_pb2.STEP_KIND_MODEL_CALL,
                }
                began = time.perf_counter()
                await send(
                    external_task_pb2.AppendStepRequest(
                        **common,
                        state=external_task_pb2.STEP_STATE_STARTED,
                        request=request_body,
                        tokens=external_task_pb2.TokenUsage(input_tokens=400),
                    )
                )
                admissions.append(time.perf_counter() - began)
                await send(
                    external_task_pb2.AppendStepRequest(
                        **common,
                        state=external_task_pb2.STEP_STATE_COMPLETED,
                        response=response_body,
                        tokens=external_task_pb2.TokenUsage(input_tokens=380, output_tokens=90),
                    )
                )

        engines = [psutil.Process(replica.process.pid) for replica in replicas]
        with _sampled(replicas, profile) as samples:
            cpu_before = sum(_cpu_seconds(p) for p in engines)
            began = time.perf_counter()
            await asyncio.gather(*(journal(index, task) for index, task in enumerate(locked)))
            elapsed = time.perf_counter() - began
            cpu = sum(_cpu_seconds(p) for p in engines) - cpu_before
    finally:
        for channel in [*channels, *plain]:
            await channel.close()
    return {
        "calls": len(admissions),
        "elapsed": elapsed,
        "admissions": admissions,
        "cpu_ms_per_call": 1000 * cpu / max(1, len(admissions)),
        "profile": samples.get("text", ""),
        "raw_profile": samples.get("raw", ""),
    }


def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def _sampled(replicas: list[EngineProcess], enabled: bool) -> Iterator[dict[str, str]]:
    """With `enabled`, py-spy samples every replica while the block runs; their stacks, summed, are
    summarized into the dict's "text" when it ends."""
    result: dict[str, str] = {}
    if not enabled:
        yield result
        return
    spy = shutil.which("py-spy") or str(pathlib.Path(sys.executable).parent / "py-spy")
    with tempfile.TemporaryDirectory() as out:
        files = [pathlib.Path(out) / f"replica-{i}.txt" for i in range(len(replicas))]
        spies = [
            subprocess.Popen(
                [spy, "record", "-p", str(r.process.pid), "-f", "raw", "-o", str(f), "-r", "200"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for r, f in zip(replicas, files, strict=True)
        ]
        time.sleep(1)  # py-spy attaches
        try:
            yield result
        finally:
            for spy_process in spies:
                spy_process.send_signal(signal.SIGINT)
            for spy_process in spies:
                spy_process.wait(60)
        raw = "\n".join(f.read_text() for f in files if f.exists())
        result["text"] = profile_engine.summarize(raw)
        result["raw"] = raw


async def deploy(replica: EngineProcess) -> None:
    async with replica.channel() as channel:
        stub = definition_pb2_grpc.DefinitionServiceStub(channel)
        for process, model in (("quota", "quota-model"), ("unlimited", "gemini-no-profile-model")):
            content = BUNDLE.replace("{process}", process).replace("{model}", model)
            content = content.replace("{{", "{").replace("}}", "}")
            await stub.Deploy(definition_pb2.DeployRequest(source_name="bench.yaml", content=content))


async def admission_ceiling(
    database_url: str, batch: int, connections: int = 16, seconds: float = 3.0
) -> float:
    """Admissions per second of one model straight through the database function, in batches of
    `batch` calls (as an engine's admission line sends them under load), from many connections at
    once: what every replica together can reach at most. Each batch's calls then leave the admitted
    calls as settlement takes them out (here without journal steps to finish)."""
    pools = [await asyncpg.connect(database_url) for _ in range(connections)]
    admitted = 0
    stop_at = time.perf_counter() + seconds
    quota = model_quotas.Quota("ceiling-model", 100_000_000, 100_000_000_000, 1_000_000, 62)

    async def loop(conn: asyncpg.Connection) -> None:
        nonlocal admitted
        while time.perf_counter() < stop_at:
            calls = [model_quotas.ModelCall(uuid.uuid4(), 1, 1, 400) for _ in range(batch)]
            admissions = await model_quotas.admit(conn, quota, calls)
            admitted += sum(a.admitted for a in admissions)
            await conn.execute(
                "DELETE FROM model_quota_calls WHERE task_id = ANY($1::uuid[])", [c.task_id for c in calls]
            )

    began = time.perf_counter()
    try:
        await asyncio.gather(*(loop(conn) for conn in pools))
    finally:
        for conn in pools:
            await conn.close()
    return admitted / (time.perf_counter() - began)


def measure(tasks: int, calls: int, profile: bool = False) -> dict[str, Any]:
    # Replicas must share their keys, as in a deployment.
    shared = {
        "ABADA_JOURNAL_KEYS": "bench:" + base64.b64encode(os.urandom(32)).decode(),
        "ABADA_IDEMPOTENCY_SECRET": secrets.token_urlsafe(32),
    }
    with scratch_database() as url, ExitStack() as stack:
        replicas = [stack.enter_context(engine_process(url, shared)) for _ in range(2)]
        asyncio.run(deploy(replicas[0]))
        quota = asyncio.run(run(replicas, "quota", tasks, calls, profile))
        unlimited = asyncio.run(run(replicas, "unlimited", tasks, calls, profile))
        via_workers = asyncio.run(run(replicas, "quota", tasks, calls, through_workers=True))
        floor = asyncio.run(bare_grpc_rate(replicas[0].address))
        try:
            ceiling = asyncio.run(admission_ceiling(url, batch=1))
            batched_ceiling = asyncio.run(admission_ceiling(url, batch=8))
        except (asyncpg.UndefinedFunctionError, asyncpg.TooManyConnectionsError) as error:
            # Another checkout's engine (ABADA_BENCH_ENGINE_SRC), or a database shared past its limit.
            print(f"admission ceiling not measured: {error}")
            ceiling = batched_ceiling = float("nan")
    rate = quota["calls"] / quota["elapsed"]
    peer = unlimited["calls"] / unlimited["elapsed"]
    return {
        "rate": rate,
        "calls": quota["calls"],
        "elapsed": quota["elapsed"],
        "p50": percentile(quota["admissions"], 0.5),
        "p99": percentile(quota["admissions"], 0.99),
        "peer": peer,
        "peer_p50": percentile(unlimited["admissions"], 0.5),
        "peer_p99": percentile(unlimited["admissions"], 0.99),
        "ratio": rate / peer,
        "worker_rate": via_workers["calls"] / via_workers["elapsed"],
        "worker_p50": percentile(via_workers["admissions"], 0.5),
        "worker_cpu_ms_per_call": via_workers["cpu_ms_per_call"],
        "bare_grpc": floor,
        "ceiling": ceiling,
        "batched_ceiling": batched_ceiling,
        "cpu_ms_per_call": quota["cpu_ms_per_call"],
        "peer_cpu_ms_per_call": unlimited["cpu_ms_per_call"],
        "profile": quota["profile"],
        "peer_profile": unlimited["profile"],
        "raw_profiles": (quota["raw_profile"], unlimited["raw_profile"]),
    }


def report(result: dict[str, Any], tasks: int) -> None:
    print(
        f"model calls admitted, 2 replicas: {result['rate']:,.0f}/s ({result['calls']:.0f} calls, each STARTED "
        f"admitted + COMPLETED settled; {tasks} concurrent tasks; {result['elapsed']:.2f} s)"
    )
    print(
        f"admission (STARTED) p50 / p99:    {result['p50'] * 1000:.2f} / {result['p99'] * 1000:.2f} ms "
        f"(STARTED without quota {result['peer_p50'] * 1000:.2f} / {result['peer_p99'] * 1000:.2f} ms)"
    )
    print(f"same calls, model without quota: {result['peer']:,.0f}/s (same replicas, same run)")
    print(f"with quota / without:            {result['ratio']:.3f}")
    print(
        f"engine CPU per model call:       {result['cpu_ms_per_call']:.2f} ms with quota, "
        f"{result['peer_cpu_ms_per_call']:.2f} ms without (both replicas)"
    )
    print(
        f"admitted via 2 agent workers:    {result['worker_rate']:,.0f}/s (steps that meet go in one AppendSteps; "
        f"STARTED p50 {result['worker_p50'] * 1000:.2f} ms, {result['worker_cpu_ms_per_call']:.2f} ms engine CPU a call)"
    )
    print(
        f"bare gRPC unary calls:           {result['bare_grpc']:,.0f}/s at 8 callers (one replica, same run)"
    )
    print(
        f"admission alone, in PostgreSQL:  {result['ceiling']:,.0f}/s one call a statement, "
        f"{result['batched_ceiling']:,.0f}/s 8 calls a statement (16 connections, one model, same run)"
    )
    print("target: >= 1,000 model calls admitted/s across 2 replicas")
    if result["profile"]:
        print("\nwhere the replicas' CPU went, with quota (py-spy):")
        print(result["profile"])
        print("\nwithout quota:")
        print(result["peer_profile"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--calls", type=int, default=60, help="model calls per task")
    parser.add_argument("--profile", action="store_true", help="sample the replicas with py-spy")
    parser.add_argument(
        "--profile-raw", help="keep py-spy's raw stacks in PATH-quota.txt, PATH-unlimited.txt"
    )
    args = parser.parse_args()
    result = measure(args.tasks, args.calls, args.profile or bool(args.profile_raw))
    report(result, args.tasks)
    if args.profile_raw:
        for name, raw in zip(("quota", "unlimited"), result["raw_profiles"], strict=True):
            pathlib.Path(f"{args.profile_raw}-{name}.txt").write_text(raw)


if __name__ == "__main__":
    main()
