"""`abada dependencies`, `abada incidents --reason/--dependency` and `abada resolve --all` after an outage."""

from __future__ import annotations

import asyncio

from abada.engine.v1 import dependency_pb2, external_task_pb2
from cli_support import abada
from engine_helpers import ONE_AGENT_TASK, leased

AGENT = "abada:agent"
MODEL = dependency_pb2.Dependency(kind=dependency_pb2.DEPENDENCY_KIND_MODEL, name="gemini-3.6-flash")
SHORT_BUDGET = ONE_AGENT_TASK.replace("next: done", "outage_budget: PT0.2S\n        next: done")


async def _down(engine, task: external_task_pb2.ExternalTask, retry_after_ms: int = 0):  # type: ignore[no-untyped-def]
    return await engine.tasks.ReportDependency(
        external_task_pb2.ReportDependencyRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            dependency=MODEL,
            error_message="Gemini answered 503 UNAVAILABLE",
            retry_after_ms=retry_after_ms,
            wait_in_place=True,
        )
    )


async def test_dependencies_shows_what_is_down_and_the_tasks_held_for_it(engine):
    first, second = await leased(engine, ONE_AGENT_TASK, "think", AGENT, 2)
    await _down(engine, first)
    await _down(engine, second)

    table = await abada(engine.address, "dependencies")
    listed = await abada(engine.address, "dependencies", "-o", "json")

    assert table.exit_code == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[:4] == ["DEPENDENCY", "STATE", "DOWN", "FOR"]
    assert row.split()[:2] == ["model:gemini-3.6-flash", "down"]
    (status,) = listed.json()["dependencies"]
    assert status["dependency"] == {"kind": "model", "name": "gemini-3.6-flash"}
    assert status["heldTasks"] == 1
    assert status["probeTaskId"] == first.id


async def test_incidents_of_one_dependency_are_listed_and_retried_in_one_command(engine):
    tasks = await leased(engine, SHORT_BUDGET, "think", AGENT, 3)
    for task in tasks:
        await _down(engine, task, retry_after_ms=60_000)  # parked, each with a 0.2 s budget
    listed = None
    for _ in range(50):  # the engine's outage-budget round raises the incidents
        listed = await abada(
            engine.address,
            "incidents",
            "--reason",
            "DEPENDENCY_UNAVAILABLE",
            "--dependency",
            "model:gemini-3.6-flash",
            "-o",
            "json",
        )
        if len(listed.json().get("incidents", [])) == 3:
            break
        await asyncio.sleep(0.2)
    assert listed is not None and len(listed.json()["incidents"]) == 3, listed.stdout

    retried = await abada(
        engine.address,
        "resolve",
        "--all",
        "--reason",
        "DEPENDENCY_UNAVAILABLE",
        "--dependency",
        "model:gemini-3.6-flash",
        "--retry",
        "--comment",
        "the provider is back",
    )

    assert retried.exit_code == 0, retried.stderr
    assert retried.stdout.startswith("resolved 3 incident(s)")
    left = await abada(engine.address, "incidents", "--reason", "DEPENDENCY_UNAVAILABLE", "-o", "json")
    assert left.json().get("incidents", []) == []


async def test_resolve_all_needs_a_reason_and_one_bulk_decision(engine):
    no_reason = await abada(engine.address, "resolve", "--all", "--retry")
    two = await abada(engine.address, "resolve", "--all", "--reason", "X", "--retry", "--cancel")
    bad_dependency = await abada(engine.address, "incidents", "--dependency", "gemini")

    assert no_reason.exit_code == 2 and "--all --reason TYPE" in no_reason.stderr
    assert two.exit_code == 2 and "exactly one of --retry or --cancel" in two.stderr
    assert bad_dependency.exit_code == 2 and "KIND:NAME" in bad_dependency.stderr
