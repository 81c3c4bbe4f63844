"""`abada journal` on an agent task whose worker journaled a model call."""

from __future__ import annotations

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
        # A journal the engine does not keep is a failure, never a skip: the CLI would show nothing.
        await engine.tasks.AppendStep(request)
    return task.id


async def test_journal_shows_steps_in_sequence(engine):
    task_id = await journaled_task(engine)
    ran = await abada(engine.address, "journal", task_id)
    assert ran.exit_code == 0, ran.stderr
    header, row = ran.stdout.splitlines()
    assert header.split()[:4] == ["SEQ", "ATTEMPT", "KIND", "STATE"]
    assert row.split()[:6] == ["1", "1", "MODEL_CALL", "COMPLETED", "-", "120/35"]
    assert "text=The parcel is lost" in row


async def test_journal_json_carries_the_full_payloads(engine):
    task_id = await journaled_task(engine)
    steps = (await abada(engine.address, "journal", task_id, "--json")).json()["steps"]
    assert [(s["sequence"], s["state"]) for s in steps] == [(1, "completed")]
    assert steps[0]["response"] == {"text": "The parcel is lost"}
    assert steps[0]["tokens"] == {"inputTokens": 120, "outputTokens": 35}


async def test_journal_of_a_task_without_steps_says_so(engine):
    await deploy(engine, THINKER)
    await start(engine, "thinker", message="hello")
    task = await fetch_one(engine, "abada:agent")
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
    assert abandoned.split()[:9] == ["2", "1", "MODEL_CALL", "STARTED", "-", "-", "-", "-", "yes"]
    cells = unknown.split()
    assert cells[:8] == [
        "4",
        "2",
        "TOOL_CALL",
        "OUTCOME_UNKNOWN",
        "crm/create_ticket",
        "-",
        "-",
        "9f86d081884…",
    ]
    assert 'arguments={"customerId":"C-42"}, callId…' in unknown


PRICED_THINKER = THINKER.replace(
    "processes:",
    """models:
  - name: gemini-3.6-flash
    provider: gemini
    price: { input_per_million_usd: 0.30, output_per_million_usd: 2.50 }
processes:""",
    1,
).replace("result_variable: summary", "result_variable: summary\n        limits: { max_tokens: 1000000 }")


async def test_journal_and_show_give_each_model_calls_cost_and_the_total(engine):
    await deploy(engine, PRICED_THINKER)
    instance = await start(engine, "thinker", message="My parcel never arrived")
    task = await fetch_one(engine, "abada:agent")
    for sequence, tokens in ((1, (120_000, 35_000)), (2, (200_000, 10_000))):
        for state in (external_task_pb2.STEP_STATE_STARTED, external_task_pb2.STEP_STATE_COMPLETED):
            request = external_task_pb2.AppendStepRequest(
                task_id=task.id,
                worker_id="cli-test-worker",
                lease_token=task.lease_token,
                attempt=task.attempt,
                sequence=sequence,
                kind=external_task_pb2.STEP_KIND_MODEL_CALL,
                state=state,
            )
            if state == external_task_pb2.STEP_STATE_COMPLETED:
                request.response.CopyFrom(struct({"text": "lost"}))
                request.tokens.CopyFrom(
                    external_task_pb2.TokenUsage(input_tokens=tokens[0], output_tokens=tokens[1])
                )
            else:
                request.request.CopyFrom(struct({"turn": sequence - 1}))
            await engine.tasks.AppendStep(request)

    ran = await abada(engine.address, "journal", task.id)
    assert ran.exit_code == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert "COST" in lines[0].split()
    # 120k in at $0.30/M + 35k out at $2.50/M; then 200k in + 10k out.
    assert "$0.123500" in lines[1] and "$0.085000" in lines[2]
    assert lines[-1] == "model cost: $0.208500 over 2 priced model call(s)"

    await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="cli-test-worker",
            lease_token=task.lease_token,
            variables=struct({"summary": "lost"}),
            metadata=external_task_pb2.AttemptMetadata(
                input_tokens=320_000, output_tokens=45_000, model_calls=2
            ),
        )
    )
    shown = await abada(engine.address, "show", instance.id)
    assert shown.exit_code == 0, shown.stderr
    assert "model cost" in shown.stdout and "$0.208500" in shown.stdout
