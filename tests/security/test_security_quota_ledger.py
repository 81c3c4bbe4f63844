"""Finding 2: the model-quota ledger answered to anyone with a worker token.

Budgets and admission ran before the lease check, so a stranger's refused STARTED still spent them:
its refusal gave back the holder's admission (a second call then ran past `max_concurrent_calls: 1`),
and STARTEDs at made-up sequences queued phantom waiters in front of the real holder.
"""

from __future__ import annotations

import grpc
import pytest
from engine_helpers import append, complete, deploy, error_info, fetch, start
from sqlalchemy import text

ONE_AT_A_TIME = """
models:
  - { name: quota-model, provider: gemini, max_concurrent_calls: 1 }
processes:
  - id: quota
    start: agent
    nodes:
      - id: agent
        type: agent
        model: quota-model
        prompt: p
        result_variable: r
        limits: { max_model_calls: 30 }
        next: done
      - { id: done, type: end }
"""


async def _started(engine, task, sequence: int, worker_id: str, estimate: int = 0):
    return await append(
        engine,
        task,
        sequence,
        "MODEL_CALL",
        "STARTED",
        request={"turn": sequence},
        tokens=(estimate, 0),
        worker_id=worker_id,
    )


async def _refused(call) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return error_info(caught.value).reason


async def _admitted_calls(db) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM model_quota_calls"))).scalar_one())


async def _waiters(db) -> int:
    async with db.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM model_quota_waiters"))).scalar_one())


async def test_a_strangers_refused_started_does_not_free_the_holders_admission(engine, db):
    await deploy(engine, ONE_AT_A_TIME)
    await start(engine, "quota")
    await start(engine, "quota")
    first, second = await fetch(engine, "holder", "abada:agent", max_tasks=2)
    await _started(engine, first, 1, "holder")
    assert await _admitted_calls(db) == 1

    assert await _refused(_started(engine, first, 1, "stranger")) == "NOT_LEASE_HOLDER"
    assert await _admitted_calls(db) == 1  # the holder's call still holds the only slot

    # So the other task's call still waits for it, as `max_concurrent_calls: 1` says.
    assert await _refused(_started(engine, second, 1, "holder")) == "MODEL_QUOTA_EXHAUSTED"


async def test_a_stranger_queues_no_phantom_waiters(engine, db):
    await deploy(engine, ONE_AT_A_TIME)
    await start(engine, "quota")
    await start(engine, "quota")
    first, second = await fetch(engine, "holder", "abada:agent", max_tasks=2)
    await _started(engine, first, 1, "holder")
    for sequence in range(2, 22):
        reason = await _refused(_started(engine, second, sequence, "stranger", estimate=10**12))
        assert reason == "NOT_LEASE_HOLDER"
    assert await _waiters(db) == 0


async def test_the_holder_cannot_queue_made_up_sequences_either(engine, db):
    await deploy(engine, ONE_AT_A_TIME)
    await start(engine, "quota")
    await start(engine, "quota")
    first, second = await fetch(engine, "holder", "abada:agent", max_tasks=2)
    await _started(engine, first, 1, "holder")
    for sequence in range(5, 25):
        assert await _refused(_started(engine, second, sequence, "holder")) == "SEQUENCE_GAP"
    assert await _waiters(db) == 0


async def test_a_completed_tasks_id_spends_nothing(engine, db):
    await deploy(engine, ONE_AT_A_TIME)
    await start(engine, "quota")
    [task] = await fetch(engine, "holder", "abada:agent")
    await _started(engine, task, 1, "holder")
    await append(
        engine, task, 1, "MODEL_CALL", "COMPLETED", request={"turn": 1}, response={"r": 1}, worker_id="holder"
    )
    await complete(engine, task, "holder", {"r": 1})
    assert await _refused(_started(engine, task, 2, "holder", estimate=10**12)) == "TASK_NOT_LEASED"
    assert await _admitted_calls(db) == 0
    assert await _waiters(db) == 0


async def test_a_resent_started_that_is_then_refused_keeps_its_admission(engine, db):
    """A release gives back only what its own request admitted: the holder's re-send, refused because the
    request changed, leaves the first send's admission in place."""
    await deploy(engine, ONE_AT_A_TIME)
    await start(engine, "quota")
    [task] = await fetch(engine, "holder", "abada:agent")
    await _started(engine, task, 1, "holder")
    different = append(
        engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": "other"}, worker_id="holder"
    )
    assert await _refused(different) == "SEQUENCE_CONFLICT"
    assert await _admitted_calls(db) == 1
