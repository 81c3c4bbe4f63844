"""`abada journal` on an agent task whose worker journaled a model call."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2
from abada_engine.cli import views
from cli_support import abada, fetch_one
from engine_helpers import deploy, start, struct

# An agent node with no tools, so deploy has no tool server to dial.
THINKER = """
processes:
  - id: thinker
    start: think
    nodes:
      - id: think
        type: agent
        model: gemini-3.6-flash
        prompt: Summarise ${message}
        result_variable: summary
        next: done
      - { id: done, type: end }
"""


async def journaled_task(engine) -> str:
    await deploy(engine, THINKER)
    await start(engine, "thinker", message="My parcel never arrived")
    task = await fetch_one(engine, "abada:agent")
    for state, response, tokens in (
        (external_task_pb2.STEP_STATE_STARTED, None, None),
        (
            external_task_pb2.STEP_STATE_COMPLETED,
            {"text": "The parcel is lost"},
            external_task_pb2.TokenUsage(input_tokens=120, output_tokens=35),
        ),
    ):
        request = external_task_pb2.AppendStepRequest(
            task_id=task.id,
            worker_id="cli-test-worker",
            lease_token=task.lease_token,
            attempt=task.attempt,
            sequence=1,
            kind=external_task_pb2.STEP_KIND_MODEL_CALL,
            state=state,
            request=struct({"model": "gemini-3.6-flash", "turn": 1}),
        )
        if response is not None:
            request.response.CopyFrom(struct(response))
        if tokens is not None:
            request.tokens.CopyFrom(tokens)
        try:
            await engine.tasks.AppendStep(request)
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                pytest.skip("the engine does not implement AppendStep yet, so there is no journal to show")
            raise
    return task.id


async def skip_while_unimplemented(engine, task_id: str) -> None:
    try:
        await engine.tasks.GetJournal(external_task_pb2.GetJournalRequest(task_id=task_id))
    except grpc.aio.AioRpcError as error:
        if error.code() == grpc.StatusCode.UNIMPLEMENTED:
            pytest.skip("the engine does not implement GetJournal yet")
        raise


async def test_journal_shows_steps_in_sequence(engine):
    task_id = await journaled_task(engine)
    await skip_while_unimplemented(engine, task_id)
    ran = await abada(engine.address, "journal", task_id)
    assert ran.exit_code == 0, ran.stderr
    header, row = ran.stdout.splitlines()
    assert header.split()[:4] == ["SEQ", "ATTEMPT", "KIND", "STATE"]
    assert row.split()[:6] == ["1", "1", "MODEL_CALL", "COMPLETED", "-", "120/35"]
    assert "text=The parcel is lost" in row


async def test_journal_json_carries_the_full_payloads(engine):
    task_id = await journaled_task(engine)
    await skip_while_unimplemented(engine, task_id)
    steps = (await abada(engine.address, "journal", task_id, "--json")).json()["steps"]
    assert [(s["sequence"], s["state"]) for s in steps] == [(1, "STEP_STATE_COMPLETED")]
    assert steps[0]["response"] == {"text": "The parcel is lost"}
    assert steps[0]["tokens"] == {"inputTokens": "120", "outputTokens": "35"}


async def test_journal_of_a_task_without_steps_says_so(engine):
    await deploy(engine, THINKER)
    await start(engine, "thinker", message="hello")
    task = await fetch_one(engine, "abada:agent")
    await skip_while_unimplemented(engine, task.id)
    ran = await abada(engine.address, "journal", task.id)
    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout.strip() == f"no journal steps for task {task.id}"


def test_journal_view_shortens_keys_and_flags_abandoned_steps():
    steps = [
        external_task_pb2.JournalStep(
            sequence=2,
            attempt=1,
            kind=external_task_pb2.STEP_KIND_MODEL_CALL,
            state=external_task_pb2.STEP_STATE_STARTED,
            abandoned=True,
        ),
        external_task_pb2.JournalStep(
            sequence=4,
            attempt=2,
            kind=external_task_pb2.STEP_KIND_TOOL_CALL,
            state=external_task_pb2.STEP_STATE_OUTCOME_UNKNOWN,
            tool_ref="crm/create_ticket",
            idempotency_key="9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            request=struct({"callId": "call_2", "arguments": {"customerId": "C-42"}}),
        ),
    ]
    _, abandoned, unknown = views.journal_table(steps).splitlines()
    assert abandoned.split()[:8] == ["2", "1", "MODEL_CALL", "STARTED", "-", "-", "-", "yes"]
    cells = unknown.split()
    assert cells[:7] == ["4", "2", "TOOL_CALL", "OUTCOME_UNKNOWN", "crm/create_ticket", "-", "9f86d081884…"]
    assert 'arguments={"customerId":"C-42"}, callId…' in unknown
