"""A worker built with the SDK, run as a real process by the SDK tests.

Its handlers leave a line in $SDK_WORKER_TRACE for every call, so a test sees what ran where.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from abada_sdk import Task, TaskFailed, Worker

worker = Worker(
    worker_id=os.environ["ABADA_WORKER_ID"],
    concurrency=int(os.environ.get("SDK_WORKER_CONCURRENCY", "4")),
    drain_seconds=float(os.environ.get("SDK_WORKER_DRAIN_SECONDS", "0.5")),
    poll_wait_ms=1_000,
)
LEASE_MS = int(os.environ.get("SDK_WORKER_LEASE_MS", "30000"))


def trace(event: str, task: Task) -> None:
    with open(os.environ["SDK_WORKER_TRACE"], "a", encoding="utf-8") as out:
        line = {"event": event, "task": task.id, "attempt": task.attempt, "retries_left": task.retries_left}
        out.write(json.dumps(line) + "\n")


@worker.task("sdk-greet", lease_ms=LEASE_MS)
async def greet(task: Task) -> dict:
    trace("greet", task)
    return {
        "greeting": f"hello {task.variables['name']}",
        "seen": {"business_key": task.business_key, "instance": task.instance_id, "attempt": task.attempt},
    }


@worker.task("sdk-sync", lease_ms=LEASE_MS)
def shout(task: Task) -> dict:
    trace("sync", task)
    return {"shouted": str(task.variables["name"]).upper()}


@worker.task("sdk-broken", lease_ms=LEASE_MS)
async def broken(task: Task) -> dict:
    trace("broken", task)
    raise RuntimeError(f"the mail server said no (attempt {task.attempt})")


@worker.task("sdk-refused", lease_ms=LEASE_MS)
async def refused(task: Task) -> dict:
    trace("refused", task)
    raise TaskFailed("the address is invalid", retry=False, code="BAD_ADDRESS")


@worker.task("sdk-slow", lease_ms=LEASE_MS)
async def slow(task: Task) -> dict:
    trace("slow", task)
    await asyncio.sleep(3600)
    return {}


@worker.task("sdk-long", lease_ms=LEASE_MS)
async def long_running(task: Task) -> dict:
    trace("long", task)
    await asyncio.sleep(float(task.variables["seconds"]))
    return {"slept": task.variables["seconds"]}


def _calls_so_far(event: str) -> int:
    with open(os.environ["SDK_WORKER_TRACE"], encoding="utf-8") as calls:
        return sum(1 for line in calls if f'"{event}"' in line)


@worker.task("sdk-flaky", lease_ms=LEASE_MS)
async def flaky(task: Task) -> dict:
    """The mail server is down for the first `outage_calls` calls (a restart), then answers."""
    trace("flaky", task)
    if _calls_so_far("flaky") <= int(task.variables["outage_calls"]):
        if task.variables.get("as") == "connection":
            raise ConnectionRefusedError(111, "Connection refused: smtp.internal:25")
        raise TaskFailed("the mail server is restarting", transient=True, dependency="smtp")
    return {"sent": True}


if __name__ == "__main__":
    print("sdk worker starting", file=sys.stderr, flush=True)
    worker.run()
