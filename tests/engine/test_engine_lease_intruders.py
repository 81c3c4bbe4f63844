"""Another worker holding the real lease token is refused, even as the very first caller.

Review finding: the guarded one-statement Complete (and AppendStep, ExtendLease) could lose its
`lease_owner` check and no test noticed, because the existing test tries a forged token first, which
consumes the replica's remembered lease and sends the intruder down the careful path. Here the intruder,
with the real token and valid variables, is the first caller on each path; then the holder's call works.
"""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import (
    ONE_SERVICE_TASK,
    append,
    complete,
    deploy,
    error_info,
    fetch,
    history_types,
    instance,
    start,
)

AGENT = """
processes:
  - id: triage
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: decide
        result_variable: triage
        output_schema: { type: object, required: [priority] }
        next: done
      - { id: done, type: end }
"""
VALID = {"triage": {"priority": "high"}}


async def _refused_as_not_holder(call) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"


@pytest.mark.parametrize(
    ("bundle", "process", "topic", "variables"),
    [
        (AGENT, "triage", "abada:agent", VALID),
        (ONE_SERVICE_TASK, "job", "jobs", {"sent": True}),
    ],
)
async def test_complete_by_an_intruder_with_the_real_token_first(engine, bundle, process, topic, variables):
    await deploy(engine, bundle)
    started = await start(engine, process)
    [task] = await fetch(engine, "holder", topic)

    await _refused_as_not_holder(complete(engine, task, "intruder", variables))
    assert (await instance(engine, started.id)).current_node_id == task.node_id
    assert ("TASK_COMPLETED", task.node_id) not in await history_types(engine, started.id)

    done = await complete(engine, task, "holder", variables)
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    history = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    [completed] = [e for e in history.events if e.type == "TASK_COMPLETED"]
    assert completed.data["worker_id"] == "holder"


async def test_append_step_by_an_intruder_with_the_real_token_first(engine):
    await deploy(engine, AGENT)
    await start(engine, "triage")
    [task] = await fetch(engine, "holder", "abada:agent")
    await _refused_as_not_holder(
        append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id="intruder")
    )
    appended = await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id="holder")
    assert appended.step.sequence == 1


async def test_extend_lease_by_an_intruder_with_the_real_token_first(engine):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    [task] = await fetch(engine, "holder", "jobs", lease_ms=5_000)

    def extend(worker_id: str):
        return engine.tasks.ExtendLease(
            external_task_pb2.ExtendLeaseRequest(
                task_id=task.id, worker_id=worker_id, lease_token=task.lease_token, lease_ms=60_000
            )
        )

    await _refused_as_not_holder(extend("intruder"))
    extended = await extend("holder")
    assert extended.lease_expires_at.ToDatetime() > task.lease_expires_at.ToDatetime()
