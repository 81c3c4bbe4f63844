"""Refusals never echo unbounded input: a 5,000-character id, topic or name still arrives as its own
status with its ErrorInfo, under the client's default 8 KiB metadata limit."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import definition_pb2, external_task_pb2, process_pb2
from engine_helpers import bad_request, error_info

LONG = "x" * 5_000
WIDE = "é" * 5_000  # two bytes each in UTF-8, six once percent-encoded in grpc-message


def _bundle_with_problems(name: str, count: int) -> str:
    nodes = "\n".join(
        f"      - {{ id: n{i}, type: service, topic: t, next: {name}{i} }}" for i in range(count)
    )
    return f"processes:\n  - id: {name}\n    start: n0\n    nodes:\n{nodes}\n"


CASES = [
    (
        "GetInstance id",
        lambda e: e.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=LONG)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "GetInstance wide id",
        lambda e: e.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=WIDE)),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "StartInstance process",
        lambda e: e.processes.StartInstance(process_pb2.StartInstanceRequest(process_id=LONG)),
        grpc.StatusCode.NOT_FOUND,
    ),
    (
        "FetchAndLock topic twice",
        lambda e: e.tasks.FetchAndLock(
            external_task_pb2.FetchAndLockRequest(
                worker_id="w",
                topics=[external_task_pb2.TopicSubscription(name=WIDE, lease_ms=1000)] * 2,
                max_tasks=1,
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    (
        "Deploy with many long problems",
        lambda e: e.definitions.Deploy(
            definition_pb2.DeployRequest(source_name=LONG, content=_bundle_with_problems("p" + "y" * 300, 60))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
]


@pytest.mark.parametrize(("name", "call", "code"), CASES, ids=[case[0] for case in CASES])
async def test_a_refusal_of_a_huge_input_keeps_its_status_and_reason(engine, name, call, code):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call(engine)
    error = caught.value
    assert error.code() == code, (error.code(), (error.details() or "")[:300])
    info = error_info(error)
    assert info.reason and info.domain == "abada.dev"
    assert len((error.details() or "").encode()) <= 1_000
    trailers = sum(len(key) + len(value) for key, value in (error.trailing_metadata() or ()))
    assert trailers < 8 * 1024


async def test_a_long_list_of_problems_says_how_many_were_left_out(engine):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.definitions.Deploy(
            definition_pb2.DeployRequest(
                source_name="many.yaml", content=_bundle_with_problems("p" + "y" * 300, 60)
            )
        )
    problems = bad_request(caught.value)
    assert len(problems) > 1
    assert "more problem" in problems[-1]
