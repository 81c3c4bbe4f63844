"""Finding 5: a finished model call could be journaled without its STARTED.

Budgets and quotas bind at a model call's STARTED; a COMPLETED model step at a fresh sequence was
accepted with whatever tokens it claimed ($32 journaled against a $1 budget). And a reply too large
for the journal was refused, asked again and paid again, while the journal showed nothing spent.
"""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2
from abada_sdk.connection import BearerToken
from abada_worker.conversation import FunctionCall, ModelReply
from abada_worker.engine_client import EngineClient, LeaseRef
from abada_worker.journal import Journal
from engine_helpers import append, deploy, error_info, fetch, journal, plain, start

BUDGETED = """
models:
  - { name: priced-model, provider: gemini, price: { input_per_million_usd: 1.0, output_per_million_usd: 1.0 } }
processes:
  - id: budgeted
    start: agent
    nodes:
      - id: agent
        type: agent
        model: priced-model
        prompt: p
        result_variable: r
        limits: { max_model_calls: 5, max_cost_usd: 1.0, max_tokens: 100000000000 }
        next: done
      - { id: done, type: end }
"""


@pytest.mark.parametrize("state", ["COMPLETED", "FAILED"])
async def test_a_finished_model_call_without_its_started_is_refused(engine, state):
    await deploy(engine, BUDGETED)
    await start(engine, "budgeted")
    [task] = await fetch(engine, "w", "abada:agent")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await append(
            engine, task, 1, "MODEL_CALL", state, response={"text": "free"}, tokens=(16_000_000, 16_000_000)
        )
    assert error_info(caught.value).reason == "MODEL_CALL_NOT_STARTED"
    assert await journal(engine, task.id) == []


async def test_a_finished_model_call_finishes_its_own_started(engine):
    await deploy(engine, BUDGETED)
    await start(engine, "budgeted")
    [task] = await fetch(engine, "w", "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "ok"}, tokens=(10, 5))
    [step] = await journal(engine, task.id)
    assert (step.tokens.input_tokens, step.tokens.output_tokens) == (10, 5)


async def test_a_too_large_reply_is_journaled_truncated_with_its_real_tokens(engine, engine_tokens):
    """A reply with 1.1 MB of arguments: its COMPLETED was refused (over the journal's 1 MB), the worker
    asked again and the provider billed each time, while the journal showed 0 tokens. Now it is
    journaled once, truncated, with what it cost."""
    await deploy(engine, BUDGETED)
    await start(engine, "budgeted")
    [task] = await fetch(engine, "w", "abada:agent")
    lease = LeaseRef(task.id, task.lease_token, task.attempt)
    huge = FunctionCall("c1", "write_everything", {"blob": "x" * 1_100_000})
    reply = ModelReply("Here it is.", (huge,), "STOP", input_tokens=1_000, output_tokens=300_000)
    async with grpc.aio.insecure_channel(engine.address) as channel:
        steps = Journal(EngineClient(channel, "w", BearerToken(engine_tokens.suite)), lease, next_sequence=1)
        sequence = await steps.start_model_call(0, "priced-model", "gemini")
        too_large = await steps.finish_model_call(sequence, reply)
    assert too_large is not None and too_large > 1_100_000
    [step] = await journal(engine, task.id)
    assert step.state == external_task_pb2.STEP_STATE_COMPLETED
    assert (step.tokens.input_tokens, step.tokens.output_tokens) == (1_000, 300_000)
    assert step.cost_usd > 0
    response = plain(step.response)
    assert response["functionCalls"] == [] and response["truncated"]["functionCalls"] == 1
