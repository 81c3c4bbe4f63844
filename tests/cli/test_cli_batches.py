"""`abada batch ...` and `abada batches`: creating batches over a filter, following them, ending them."""

from __future__ import annotations

import asyncio
import json

from abada.engine.v1 import external_task_pb2, process_pb2
from cli_support import abada, fetch_one
from engine_helpers import deploy, instance, start

BUNDLE = """
processes:
  - id: cli_batch
    start: call
    nodes:
      - { id: call, type: service, topic: cli-batch-call, retries: 0, next: done }
      - { id: done, type: end }
"""


async def _shown(engine, batch_id: str) -> dict:
    shown = await abada(engine.address, "batch", "show", batch_id, "-o", "json")
    assert shown.exit_code == 0, shown.stderr
    return json.loads(shown.stdout)


async def _finished(engine, batch_id: str) -> dict:
    for _ in range(50):  # the engine's own job works through it (a round a second)
        data = await _shown(engine, batch_id)
        if data["batch"]["state"] == "completed":
            return data
        await asyncio.sleep(0.2)
    raise AssertionError(f"batch {batch_id} did not complete: {data}")


async def test_retry_incidents_batch_is_created_followed_and_listed(engine):
    await deploy(engine, BUNDLE)
    held = (await start(engine, "cli_batch")).id
    task = await fetch_one(engine, "cli-batch-call")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id, worker_id="cli-test-worker", lease_token=task.lease_token, error_message="boom"
        )
    )
    # --version is the command's own option here, not the top-level one printing abada's version.
    created = await abada(
        engine.address,
        "batch",
        "retry-incidents",
        "--process",
        "cli_batch",
        "--type",
        "FAILED_TASK",
        "--version",
        "1",
    )
    assert created.exit_code == 0, created.stderr
    assert "1 instance(s) matched" in created.stdout
    batch_id = created.stdout.split()[1].rstrip(":")

    data = await _finished(engine, batch_id)
    assert data["batch"]["done"] == 1
    assert [(i["instanceId"], i["outcome"]) for i in data["items"]] == [(held, "done")]
    card = await abada(engine.address, "batch", "show", batch_id)
    assert "COMPLETED" in card.stdout and "1/1" in card.stdout and held in card.stdout
    listed = await abada(engine.address, "batches")
    assert batch_id in listed.stdout and "retry-incidents" in listed.stdout

    refused = await abada(engine.address, "batch", "pause", batch_id)
    assert refused.exit_code == 1 and "completed" in refused.stderr


async def test_cancel_batch_asks_first_and_needs_a_reason(engine):
    await deploy(engine, BUNDLE)
    started = (await start(engine, "cli_batch")).id
    no_reason = await abada(engine.address, "batch", "cancel", "--process", "cli_batch", "--yes")
    assert no_reason.exit_code == 2 and "--reason" in no_reason.stderr
    unasked = await abada(engine.address, "batch", "cancel", "--process", "cli_batch", "--reason", "cleanup")
    assert unasked.exit_code == 2 and "add --yes" in unasked.stderr
    created = await abada(
        engine.address,
        "batch",
        "cancel",
        "--process",
        "cli_batch",
        "--reason",
        "cleanup",
        "--yes",
        "-o",
        "json",
    )
    assert created.exit_code == 0, created.stderr
    batch_id = json.loads(created.stdout)["batch"]["id"]
    await _finished(engine, batch_id)
    assert (await instance(engine, started)).state == process_pb2.INSTANCE_STATE_CANCELED
    # BATCH given, `batch cancel` ends that batch instead: this one has ended already.
    again = await abada(engine.address, "batch", "cancel", batch_id)
    assert again.exit_code == 1 and "completed" in again.stderr


async def test_migrate_and_modify_batches_over_a_filter(engine):
    await deploy(engine, BUNDLE)
    keyed = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id="cli_batch", business_key="cust-1")
    )
    other = (await start(engine, "cli_batch")).id
    await deploy(engine, BUNDLE.replace("retries: 0", "retries: 2"))

    needs_version = await abada(
        engine.address, "batch", "migrate", "--process", "cli_batch", "--to", "2", "--yes"
    )
    assert needs_version.exit_code == 2 and "--version" in needs_version.stderr
    migrated = await abada(
        engine.address,
        "batch",
        "migrate",
        "--process",
        "cli_batch",
        "--version",
        "1",
        "--to",
        "2",
        "--map",
        "call=call",
        "--yes",
        "-o",
        "json",
    )
    assert migrated.exit_code == 0, migrated.stderr
    data = await _finished(engine, json.loads(migrated.stdout)["batch"]["id"])
    assert data["batch"]["done"] == 2
    assert (await instance(engine, other)).version == 2
    card = await abada(engine.address, "batch", "show", data["batch"]["id"])
    assert "v2 (call -> call)" in card.stdout

    nothing = await abada(
        engine.address, "batch", "modify", "--process", "cli_batch", "--reason", "why", "--yes"
    )
    assert nothing.exit_code == 2 and "nothing to change" in nothing.stderr
    modified = await abada(
        engine.address,
        "batch",
        "modify",
        "--process",
        "cli_batch",
        "--business-key",
        "cust-1",
        "--set",
        "tier=gold",
        "--reason",
        "upgraded",
        "--yes",
        "-o",
        "json",
    )
    assert modified.exit_code == 0, modified.stderr
    data = await _finished(engine, json.loads(modified.stdout)["batch"]["id"])
    assert [i["instanceId"] for i in data["items"]] == [keyed.instance.id]
    assert dict((await instance(engine, keyed.instance.id)).variables)["tier"] == "gold"
    assert "tier" not in dict((await instance(engine, other)).variables)
