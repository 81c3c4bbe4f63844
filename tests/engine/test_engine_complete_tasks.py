"""CompleteTasks: several completions in one call, each checked and finished on its own."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import (
    ONE_SERVICE_TASK,
    complete,
    error_info,
    fetch,
    instance,
    leased,
    plain,
    start,
    struct,
)
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

JOBS = external_task_pb2.TopicSubscription(name="jobs", lease_ms=60_000)


def completion(task: external_task_pb2.ExternalTask, **fields) -> external_task_pb2.CompleteRequest:
    return external_task_pb2.CompleteRequest(
        task_id=fields.pop("task_id", task.id),
        lease_token=fields.pop("lease_token", task.lease_token),
        **fields,
    )


def refusal_info(refusal: external_task_pb2.Refusal) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo inside a refusal's google.rpc.Status: what a failed Complete carries."""
    status = status_pb2.Status.FromString(refusal.status)
    assert (status.code, status.message) == (refusal.code, refusal.message)
    info = error_details_pb2.ErrorInfo()
    packed: any_pb2.Any
    for packed in status.details:
        if packed.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


async def jobs(engine, count: int) -> list[external_task_pb2.ExternalTask]:
    return await leased(engine, ONE_SERVICE_TASK, "job", "jobs", count)


async def test_each_completion_is_done_or_refused_on_its_own_and_answered_in_order(engine):
    first, stale, third, malformed = await jobs(engine, 4)
    answer = await engine.tasks.CompleteTasks(
        external_task_pb2.CompleteTasksRequest(
            worker_id="w",
            completions=[
                completion(first, variables=struct({"n": 1})),
                completion(stale, lease_token="not-the-lease"),
                completion(third, worker_id="w", variables=struct({"n": 3})),
                completion(malformed, variables=struct({"n": 4}), task_id="not-a-uuid"),
            ],
        )
    )
    done_first, refused_stale, done_third, refused_malformed = answer.results
    for done, task, n in ((done_first, first, 1), (done_third, third, 3)):
        assert done.completed.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
        assert done.completed.next_node_id == "done"
        finished = await instance(engine, task.instance_id)
        assert finished.state == process_pb2.INSTANCE_STATE_COMPLETED
        assert plain(finished.variables) == {"n": n}
    assert refused_stale.WhichOneof("result") == "refused"
    assert refused_stale.refused.reason == "NOT_LEASE_HOLDER" == refusal_info(refused_stale.refused).reason
    assert refused_malformed.refused.code == code_pb2.INVALID_ARGUMENT
    assert refusal_info(refused_malformed.refused).metadata["field"] == "task_id"
    assert not answer.next_tasks
    # The refused ones changed nothing: their holder still completes them, one at a time as before.
    for task in (stale, malformed):
        assert (await instance(engine, task.instance_id)).state == process_pb2.INSTANCE_STATE_ACTIVE
        assert (await complete(engine, task, "w", {})).next_node_id == "done"


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        (lambda tasks: {"completions": []}, "completions"),
        (lambda tasks: {"completions": [completion(tasks[0])] * 101}, "completions"),
        (
            lambda tasks: {"completions": [completion(tasks[0]), completion(tasks[0])]},
            "completions[1].task_id",
        ),
        (
            lambda tasks: {"completions": [completion(tasks[0]), completion(tasks[1], worker_id="other")]},
            "completions[1].worker_id",
        ),
        (
            lambda tasks: {
                "completions": [
                    completion(tasks[0]),
                    completion(tasks[1], fetch_next=external_task_pb2.FetchNext(topics=[JOBS], max_tasks=1)),
                ]
            },
            "completions[1].fetch_next",
        ),
        (
            lambda tasks: {
                "completions": [completion(tasks[0]), completion(tasks[1])],
                "fetch_next": external_task_pb2.FetchNext(
                    topics=[external_task_pb2.TopicSubscription(name="jobs", lease_ms=10)], max_tasks=1
                ),
            },
            "fetch_next.topics[0].lease_ms",
        ),
    ],
    ids=["empty", "over-100", "a-task-twice", "another-worker", "own-fetch-next", "bad-fetch-next"],
)
async def test_a_malformed_batch_is_refused_whole_and_changes_nothing(engine, batch, field):
    tasks = await jobs(engine, 2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.CompleteTasks(
            external_task_pb2.CompleteTasksRequest(worker_id="w", **batch(tasks))
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == field
    for task in tasks:
        assert (await instance(engine, task.instance_id)).state == process_pb2.INSTANCE_STATE_ACTIVE
        assert (await complete(engine, task, "w", {})).next_node_id == "done"


async def test_a_batch_with_fetch_next_hands_out_the_workers_next_tasks(engine):
    """Eager dispatch for a whole batch: one call finishes the worker's tasks and brings the next ones."""
    tasks = await jobs(engine, 3)
    for _ in range(2):
        await start(engine, "job")
    answer = await engine.tasks.CompleteTasks(
        external_task_pb2.CompleteTasksRequest(
            worker_id="w",
            completions=[completion(task) for task in tasks],
            fetch_next=external_task_pb2.FetchNext(topics=[JOBS], max_tasks=5),
        )
    )
    assert [r.completed.next_node_id for r in answer.results] == ["done"] * 3
    handed = list(answer.next_tasks)
    assert len(handed) == 2 and not {t.id for t in handed} & {t.id for t in tasks}
    assert await fetch(engine, "other", "jobs") == []  # both are under the worker's lease now
    again = await engine.tasks.CompleteTasks(
        external_task_pb2.CompleteTasksRequest(worker_id="w", completions=[completion(t) for t in handed])
    )
    assert [r.completed.next_node_id for r in again.results] == ["done"] * 2
