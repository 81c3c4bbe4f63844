"""AppendSteps: one step of each of several tasks in one call, each journaled or refused on its own."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, external_task_pb2_grpc
from abada_sdk.connection import BearerToken
from abada_sdk.status import refused_item_status
from abada_worker.engine_client import EngineClient, EngineRefused
from abada_worker.errors import LeaseLost
from engine_helpers import ONE_AGENT_TASK, append, error_info, journal, leased, step_request


async def agents(engine, count: int) -> list[external_task_pb2.ExternalTask]:
    return await leased(engine, ONE_AGENT_TASK, "think", "abada:agent", count)


class Counting(grpc.aio.UnaryUnaryClientInterceptor):
    """Counts the calls a client makes, by method name."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_unary_unary(self, continuation, details, request):
        self.calls.append(details.method.decode().rsplit("/", 1)[-1])
        return await continuation(details, request)


async def test_each_step_is_journaled_or_refused_on_its_own_and_answered_in_order(engine):
    fresh, stale, spent, gapped = await agents(engine, 4)
    await append(engine, spent, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await append(engine, spent, 1, "MODEL_CALL", "COMPLETED", response={"text": "done"}, tokens=(5, 5))
    steps = [
        step_request(fresh, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id=""),
        step_request(stale, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, lease_token="not-the-token"),
        step_request(spent, 2, "MODEL_CALL", "STARTED", request={"turn": 1}),
        step_request(gapped, 3, "MODEL_CALL", "STARTED", request={"turn": 0}),
    ]
    answer = await engine.tasks.AppendSteps(external_task_pb2.AppendStepsRequest(worker_id="w", steps=steps))

    assert [r.WhichOneof("result") for r in answer.results] == ["appended", "refused", "refused", "refused"]
    appended = answer.results[0].appended.step
    assert (appended.sequence, appended.state) == (1, external_task_pb2.STEP_STATE_STARTED)
    # Each refusal is what AppendStep alone would have failed with, details and all.
    refusals = [
        refused_item_status(r.refused.code, r.refused.message, r.refused.status) for r in answer.results[1:]
    ]
    assert [(s.code, s.reason) for s in refusals] == [
        (grpc.StatusCode.PERMISSION_DENIED, "NOT_LEASE_HOLDER"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "LIMIT_EXCEEDED"),
        (grpc.StatusCode.FAILED_PRECONDITION, "SEQUENCE_GAP"),
    ]
    assert refusals[1].metadata["limit"] == "max_model_calls"
    with pytest.raises(grpc.aio.AioRpcError) as alone:
        await engine.tasks.AppendStep(steps[3])
    assert (alone.value.code(), error_info(alone.value).reason) == (refusals[2].code, refusals[2].reason)

    # A refused step changed nothing: its task journals on as if the batch had not been.
    assert [len(await journal(engine, t.id)) for t in (fresh, stale, spent, gapped)] == [1, 0, 1, 0]
    await append(engine, stale, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    # The same step sent again in a batch gets the same answer as the first time.
    again = await engine.tasks.AppendSteps(
        external_task_pb2.AppendStepsRequest(worker_id="w", steps=[steps[0], steps[2]])
    )
    assert again.results[0].appended == answer.results[0].appended
    assert again.results[1].refused.reason == "LIMIT_EXCEEDED"


@pytest.mark.parametrize(
    ("batch", "field"),
    [
        (lambda tasks: [], "steps"),
        (lambda tasks: [step_request(tasks[0], 1, "MODEL_CALL", "STARTED")] * 101, "steps"),
        (
            lambda tasks: [
                step_request(tasks[0], 1, "MODEL_CALL", "STARTED"),
                step_request(tasks[0], 2, "MODEL_CALL", "STARTED"),
            ],
            "steps[1].task_id",
        ),
        (
            lambda tasks: [
                step_request(tasks[0], 1, "MODEL_CALL", "STARTED"),
                step_request(tasks[1], 1, "MODEL_CALL", "STARTED", worker_id="someone-else"),
            ],
            "steps[1].worker_id",
        ),
    ],
    ids=["empty", "over-100", "a-task-twice", "another-worker"],
)
async def test_a_malformed_batch_is_refused_whole_and_changes_nothing(engine, batch, field):
    tasks = await agents(engine, 2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.AppendSteps(
            external_task_pb2.AppendStepsRequest(worker_id="w", steps=batch(tasks))
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == field
    for task in tasks:
        assert await journal(engine, task.id) == []


async def test_the_agent_workers_steps_that_arrive_together_go_in_one_call(engine, engine_tokens):
    """The agent worker's engine client: the steps its tasks journal at the same moment go together in
    one AppendSteps, and each caller gets its own answer, or its own refusal."""
    tasks = await agents(engine, 12)
    counting = Counting()
    async with grpc.aio.insecure_channel(engine.address, interceptors=[counting]) as channel:
        client = EngineClient(channel, "w", BearerToken(engine_tokens.suite))

        outcomes = await asyncio.gather(
            *(client.append_step(step_request(task, 1, "MODEL_CALL", "STARTED")) for task in tasks[:10]),
            client.append_step(step_request(tasks[10], 2, "MODEL_CALL", "STARTED")),  # a gap
            client.append_step(step_request(tasks[11], 1, "MODEL_CALL", "STARTED", lease_token="stale")),
            return_exceptions=True,
        )
    assert [o.step.sequence for o in outcomes[:10]] == [1] * 10  # type: ignore[union-attr]
    # Each refusal is the worker's own exception for it, as for a refused AppendStep.
    assert isinstance(outcomes[10], EngineRefused) and outcomes[10].failure.reason == "SEQUENCE_GAP"
    assert isinstance(outcomes[11], LeaseLost)
    # The twelve arrived while nothing was on its way: one call carried them all.
    assert counting.calls == ["AppendSteps"]
    for task in tasks[:10]:
        assert [s.sequence for s in await journal(engine, task.id)] == [1]
    assert await journal(engine, tasks[11].id) == []


async def test_steps_of_one_task_that_meet_are_not_batched_together(engine, engine_tokens):
    """The engine takes one step a task per AppendSteps: the worker's client sends a task's second
    step that meets its first on its own, instead of a batch the engine would refuse whole."""
    tasks = await agents(engine, 3)
    for task in tasks:
        await append(engine, task, 1, "MODEL_CALL", "STARTED")
    counting = Counting()
    async with grpc.aio.insecure_channel(engine.address, interceptors=[counting]) as channel:
        client = EngineClient(channel, "w", BearerToken(engine_tokens.suite))
        finish = [step_request(t, 1, "MODEL_CALL", "COMPLETED", response={"text": "ok"}) for t in tasks]
        # The first task's finish twice, as a worker re-sending it would: the same answer both times.
        answers = await asyncio.gather(*(client.append_step(step) for step in [finish[0], *finish]))
    assert sorted(counting.calls) == ["AppendStep", "AppendSteps"]
    assert answers[0] == answers[1]
    assert [a.step.state for a in answers] == [external_task_pb2.STEP_STATE_COMPLETED] * 4


class OlderEngine(external_task_pb2_grpc.ExternalTaskServiceServicer):
    """An engine from before AppendSteps: it journals one step a call, and knows no other RPC."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int]] = []

    async def AppendStep(self, request, context):
        self.steps.append((request.task_id, request.sequence))
        return external_task_pb2.AppendStepResponse(
            step=external_task_pb2.JournalStep(sequence=request.sequence, state=request.state)
        )


async def test_against_an_engine_without_append_steps_the_worker_sends_one_step_a_call():
    older = OlderEngine()
    server = grpc.aio.server()
    external_task_pb2_grpc.add_ExternalTaskServiceServicer_to_server(older, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    counting = Counting()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[counting]) as channel:
            client = EngineClient(channel, "w", BearerToken("token"))

            async def steps(sequence: int) -> list[int]:
                answers = await asyncio.gather(
                    *(
                        client.append_step(
                            external_task_pb2.AppendStepRequest(task_id=f"t{n}", sequence=sequence)
                        )
                        for n in range(6)
                    )
                )
                return [a.step.sequence for a in answers]

            assert await steps(1) == [1] * 6
            # The refused batch was sent again a step at a time; from then on every step goes alone.
            assert counting.calls == ["AppendSteps", *["AppendStep"] * 6]
            assert await steps(2) == [2] * 6
            assert counting.calls[7:] == ["AppendStep"] * 6
    finally:
        await server.stop(None)
    assert sorted(older.steps) == sorted((f"t{n}", s) for n in range(6) for s in (1, 2))
