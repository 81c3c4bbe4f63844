"""Many in flight: FetchAndLock and Complete latency with 100 and with 10,000 active instances, and
StartInstance/s at 8 callers.

Each level holds the same mix: half the instances wait at a ready service task, 40 % at a service
task leased by another worker (long lease), 10 % at an agent task leased with a journal of four
steps; every instance has its history. One worker then fetches one task at a time and completes
it (a new instance replaces each completed one, untimed, so the level holds), and the p50/p99 of
both calls are printed per level, with their ratio (target: 10,000 within 1.5x of 100).

    python bench/many_in_flight.py --levels 100,10000 --cycles 1000
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
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
from common import EngineProcess, engine_process, percentile, scratch_database
from google.protobuf import struct_pb2

# Where `--explain` finds the plans test's helper (tests/kept_plans.py): how a kept plan is read.
_TESTS = str(pathlib.Path(__file__).resolve().parent.parent / "tests")

BUNDLE = """
processes:
  - id: service
    start: work
    nodes:
      - { id: work, type: service, topic: bench, next: done }
      - { id: done, type: end }
  - id: agentic
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-bench-model
        prompt: think
        result_variable: answer
        limits: { max_model_calls: 1000, max_tool_calls: 0, max_tokens: 1000000000 }
        next: done
      - { id: done, type: end }
"""

STARTERS = 8
JOURNAL_PAIRS = 2


def _struct(value: dict) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


class Fill:
    def __init__(self, channel) -> None:  # type: ignore[no-untyped-def]
        self.processes = process_pb2_grpc.ProcessServiceStub(channel)
        self.tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
        self.start_seconds = 0.0
        self.started = 0

    async def start(self, process_id: str, count: int) -> None:
        """Start `count` instances at 8 concurrent callers, timing the calls."""
        queue = iter(range(count))

        async def starter() -> None:
            for _ in queue:
                await self.processes.StartInstance(
                    process_pb2.StartInstanceRequest(process_id=process_id, variables=_struct({"n": 1}))
                )

        began = time.perf_counter()
        await asyncio.gather(*(starter() for _ in range(STARTERS)))
        self.start_seconds += time.perf_counter() - began
        self.started += count

    async def lease(self, topic: str, count: int) -> list[external_task_pb2.ExternalTask]:
        leased: list[external_task_pb2.ExternalTask] = []
        while len(leased) < count:
            batch = (
                await self.tasks.FetchAndLock(
                    external_task_pb2.FetchAndLockRequest(
                        worker_id="holder",
                        max_tasks=min(500, count - len(leased)),
                        topics=[external_task_pb2.TopicSubscription(name=topic, lease_ms=3_600_000)],
                    )
                )
            ).tasks
            if not batch:
                raise RuntimeError(f"only {len(leased)} of {count} {topic} tasks could be leased")
            leased.extend(batch)
        return leased

    async def journal(self, tasks: list[external_task_pb2.ExternalTask]) -> None:
        request = _struct({"turn": 0, "contents": "x" * 200})
        response = _struct({"text": "y" * 300})
        queue = iter(tasks)

        async def writer() -> None:
            for task in queue:
                sequence = 0
                for _ in range(JOURNAL_PAIRS):
                    for state, extra in (
                        (external_task_pb2.STEP_STATE_STARTED, {"request": request}),
                        (external_task_pb2.STEP_STATE_COMPLETED, {"response": response}),
                    ):
                        if state == external_task_pb2.STEP_STATE_STARTED:
                            sequence += 1
                        await self.tasks.AppendStep(
                            external_task_pb2.AppendStepRequest(
                                task_id=task.id,
                                worker_id="holder",
                                lease_token=task.lease_token,
                                attempt=task.attempt,
                                sequence=sequence,
                                kind=external_task_pb2.STEP_KIND_MODEL_CALL,
                                state=state,
                                **extra,
                            )
                        )

        await asyncio.gather(*(writer() for _ in range(STARTERS)))

    async def grow(self, active: int, to: int) -> None:
        """From `active` to `to` active instances, in the mix the module docstring describes."""
        more = to - active
        ready, leased_service = more // 2, more * 4 // 10
        agents = more - ready - leased_service
        await self.start("service", leased_service)
        await self.lease("bench", leased_service)
        await self.start("agentic", agents)
        await self.journal(await self.lease("abada:agent", agents))
        await self.start("service", ready)


async def cycles(fill: Fill, count: int) -> tuple[list[float], list[float]]:
    """One worker: fetch one task, complete it; a new instance (untimed) replaces it."""
    fetches: list[float] = []
    completes: list[float] = []
    request = external_task_pb2.FetchAndLockRequest(
        worker_id="probe",
        max_tasks=1,
        topics=[external_task_pb2.TopicSubscription(name="bench", lease_ms=60_000)],
    )
    for _ in range(count):
        began = time.perf_counter()
        tasks = (await fill.tasks.FetchAndLock(request)).tasks
        fetches.append(time.perf_counter() - began)
        if not tasks:
            raise RuntimeError("no ready task to fetch: the level did not hold")
        began = time.perf_counter()
        await fill.tasks.Complete(
            external_task_pb2.CompleteRequest(
                task_id=tasks[0].id, worker_id="probe", lease_token=tasks[0].lease_token
            )
        )
        completes.append(time.perf_counter() - began)
        await fill.processes.StartInstance(process_pb2.StartInstanceRequest(process_id="service"))
    return fetches, completes


async def explain(database_url: str) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the hot statements as they stand now, each rolled back, in the
    plan the engine keeps for them (made for any values)."""
    import hashlib
    import json
    import uuid

    import asyncpg
    from abada_engine.store import journal_steps, moves, tasks

    sys.path.insert(0, _TESTS)
    from kept_plans import explain_kept_plan, planned_once

    conn = await asyncpg.connect(database_url)
    out: list[str] = []
    try:
        task_id = await conn.fetchval(
            "SELECT id FROM tasks WHERE state = 'LEASED' AND topic = 'bench' LIMIT 1"
        )
        instance_id = await conn.fetchval("SELECT instance_id FROM tasks WHERE id = $1", task_id)
        probes = {
            "lease_due (FetchAndLock)": (
                tasks.LEASE_DUE,
                {
                    "topics": ["bench"],
                    "lease_ms": [60_000],
                    "max_tasks": 1,
                    "worker_id": "explain",
                    "hashes": [hashlib.sha256(b"x").digest()],
                    "takeovers": True,
                },
            ),
            "read_lease (lease checks)": (tasks.READ_LEASE, {"id": task_id}),
            "move_tokens (Complete)": (
                moves.MOVE_TOKENS,
                {
                    "moves": json.dumps(
                        [
                            {
                                "n": 0,
                                "instance_id": str(instance_id),
                                "guard_worker": "holder",
                                "guard_hash": "00",
                                "finished_task_id": str(task_id),
                                "finished_state": "COMPLETED",
                                "task_id": str(uuid.uuid4()),
                                "task_node": "done",
                                "task_kind": "external",
                                "task_state": "READY",
                                "task_payload": {},
                                "task_retries": 0,
                                "current_node": "done",
                                "completed": True,
                                "history": [],
                            }
                        ]
                    ),
                    "channel": tasks.TASK_CHANNEL,
                },
            ),
            "insert_checked (AppendStep)": (
                journal_steps.INSERT_CHECKED,
                {
                    "task_id": task_id,
                    "worker_id": "holder",
                    "token_hash": b"wrong",
                    "attempt": 1,
                    "sequence": 1,
                    "kind": "MODEL_CALL",
                    "state": "STARTED",
                    "tool_ref": "",
                    "key_id": "k",
                    "aad_version": 2,
                    "request_ct": None,
                    "response_ct": None,
                    "request_digest": None,
                    "response_digest": None,
                    "input_tokens": 0,
                    "output_tokens": 0,
                    "max_model_calls": 10,
                    "max_tool_calls": 10,
                    "max_tokens": 10,
                },
            ),
        }
        # As the engine's hot connections run them: one plan per statement, kept for any values.
        async with planned_once(conn):
            for name, (statement, params) in probes.items():
                lines = await explain_kept_plan(conn, statement, "ANALYZE, BUFFERS, COSTS OFF", params)
                out.append(f"-- {name}\n" + "\n".join(lines))
    finally:
        await conn.close()
    return "\n\n".join(out)


async def run(engine: EngineProcess, levels: list[int], count: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    async with engine.channel() as channel:
        await definition_pb2_grpc.DefinitionServiceStub(channel).Deploy(
            definition_pb2.DeployRequest(source_name="bench.yaml", content=BUNDLE)
        )
        fill = Fill(channel)
        active = 0
        for level in levels:
            await fill.grow(active, level)
            active = level
            await cycles(fill, 50)  # warm: statement caches, plans, connections
            fetches, completes = await cycles(fill, count)
            for name, samples in (("fetch", fetches), ("complete", completes)):
                figures[f"{name}_p50@{level}"] = percentile(samples, 0.5)
                figures[f"{name}_p99@{level}"] = percentile(samples, 0.99)
        figures["start_rate"] = fill.started / fill.start_seconds
    return figures


def measure(levels: list[int], count: int, show_plans: bool = False) -> dict[str, float]:
    with scratch_database() as url, engine_process(url) as engine:
        figures = asyncio.run(run(engine, levels, count))
        if show_plans:
            print(asyncio.run(explain(url)))
        return figures


def report(figures: dict[str, float], levels: list[int]) -> None:
    low, high = levels[0], levels[-1]
    for name, label in (("fetch", "FetchAndLock"), ("complete", "Complete")):
        for level in levels:
            print(
                f"{label + ' @ ' + format(level, ','):<24} p50 {figures[f'{name}_p50@{level}'] * 1000:6.2f} ms   "
                f"p99 {figures[f'{name}_p99@{level}'] * 1000:6.2f} ms"
            )
        print(
            f"{label + ' ' + format(high, ',') + ' / ' + format(low, ','):<24} "
            f"p50 {figures[f'{name}_p50@{high}'] / figures[f'{name}_p50@{low}']:.2f}x    "
            f"p99 {figures[f'{name}_p99@{high}'] / figures[f'{name}_p99@{low}']:.2f}x   (target <= 1.5x)"
        )
    print(
        f"StartInstance:           {figures['start_rate']:,.0f}/s at {STARTERS} callers (target >= 1,500/s)"
    )
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="100,10000", help="active instances, comma-separated, ascending")
    parser.add_argument(
        "--cycles",
        type=int,
        default=1000,
        help="timed fetch+complete cycles per level (p99: the 10th slowest)",
    )
    parser.add_argument(
        "--explain", action="store_true", help="print the hot statements' plans at the last level"
    )
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    report(measure(levels, args.cycles, args.explain), levels)


if __name__ == "__main__":
    main()
