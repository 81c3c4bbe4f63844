"""Finding 7: a worker could raise an incident type that only the engine raises.

`Fail(error_code="APPROVAL_TIMEOUT", no_retry=True)` became an APPROVAL_TIMEOUT incident; an
operator's RETRY on it then ran the approvals' resolution and left the task awaiting an approval
that did not exist, unfetchable for ever.
"""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2
from abada_engine.runtime.incident_types import ENGINE_INCIDENT_TYPES
from engine_helpers import ONE_SERVICE_TASK, deploy, error_info, fetch, start


async def _fail(engine, task, error_code: str) -> external_task_pb2.FailResponse:
    return await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            error_code=error_code,
            error_message="forged",
            no_retry=True,
        )
    )


@pytest.mark.parametrize("forged", sorted(ENGINE_INCIDENT_TYPES))
async def test_a_worker_cannot_raise_an_engine_incident_type(engine, forged):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _fail(engine, task, forged)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "error_code"
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=started.id))
    assert list(listed.incidents) == []
    # The lease was not spent on the refusal: the worker can still fail the task under its own name.
    await _fail(engine, task, "UPSTREAM_REJECTED")


@pytest.mark.parametrize("code", ["MODEL_CREDENTIAL_REJECTED", "TOOL_SERVER_REFUSED", "CREDENTIAL_REFUSED"])
async def test_the_workers_own_codes_still_become_incidents(engine, code):
    await deploy(engine, ONE_SERVICE_TASK)
    started = await start(engine, "job")
    [task] = await fetch(engine, "w", "jobs")
    failed = await _fail(engine, task, code)
    assert failed.incident_id
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=started.id))
    assert [incident.type for incident in listed.incidents] == [code]
