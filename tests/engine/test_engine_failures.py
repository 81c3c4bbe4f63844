"""Fail: retries with backoff, then an incident; ResolveIncident retries it."""

from __future__ import annotations

import asyncio

from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import complete, deploy, fetch, history_types, instance, start

FLAKY = """
processes:
  - id: flaky
    start: call
    nodes:
      - { id: call, type: service, topic: flaky, retries: 2, retry_backoff_ms: 300, next: done }
      - { id: done, type: end }
"""


async def _fail(engine, task, worker="w", **kwargs):
    return await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id=worker,
            lease_token=task.lease_token,
            error_code="HTTP_503",
            error_message="upstream unavailable",
            **kwargs,
        )
    )


async def test_fail_retries_with_growing_backoff_then_raises_an_incident_that_retry_resolves(engine):
    await deploy(engine, FLAKY)
    started = await start(engine, "flaky")

    [task] = await fetch(engine, "w", "flaky")
    first = await _fail(engine, task)
    assert first.will_retry
    assert await fetch(engine, "w", "flaky") == []  # still backing off
    [task] = await fetch(engine, "w", "flaky", wait_ms=2000)
    assert task.attempt == 2

    second = await _fail(engine, task)
    delay_first = first.retry_at.ToDatetime()
    assert second.will_retry and second.retry_at.ToDatetime() > delay_first
    loop = asyncio.get_running_loop()
    begun = loop.time()
    [task] = await fetch(engine, "w", "flaky", wait_ms=3000)
    assert loop.time() - begun >= 0.45  # the second backoff doubles (600 ms)
    assert task.attempt == 3

    last = await _fail(engine, task)
    assert not last.will_retry and last.incident_id
    assert await fetch(engine, "w", "flaky", wait_ms=200) == []
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    assert (incident.id, incident.type) == (last.incident_id, "FAILED_TASK")
    assert "upstream unavailable" in incident.message

    resolved = await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=incident.id, resolution=incident_pb2.RESOLUTION_RETRY, comment="upstream is back"
        )
    )
    assert resolved.incident.state == incident_pb2.INCIDENT_STATE_RESOLVED
    [task] = await fetch(engine, "w", "flaky")
    assert task.attempt == 4
    await complete(engine, task, "w", {"ok": True})
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_COMPLETED
    types = [t for t, _ in await history_types(engine, started.id)]
    assert types.count("TASK_FAILED") == 3
    assert "INCIDENT_RAISED" in types and "INCIDENT_RESOLVED" in types


async def test_no_retry_failure_raises_its_own_incident_type_at_once(engine):
    await deploy(engine, FLAKY)
    await start(engine, "flaky")
    [task] = await fetch(engine, "w", "flaky")
    response = await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            error_code="TOOL_CONTRACT_MISMATCH",
            error_message="create_ticket is gone",
            no_retry=True,
        )
    )
    assert not response.will_retry
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    assert incident.type == "TOOL_CONTRACT_MISMATCH"


async def test_cancel_resolution_cancels_the_instance(engine):
    await deploy(engine, FLAKY)
    started = await start(engine, "flaky")
    [task] = await fetch(engine, "w", "flaky")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            no_retry=True,
            error_message="broken",
        )
    )
    [incident] = (await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())).incidents
    await engine.incidents.ResolveIncident(
        incident_pb2.ResolveIncidentRequest(
            incident_id=incident.id, resolution=incident_pb2.RESOLUTION_CANCEL_INSTANCE
        )
    )
    assert (await instance(engine, started.id)).state == process_pb2.INSTANCE_STATE_CANCELED
