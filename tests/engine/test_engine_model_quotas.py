"""Model quotas and spend budgets, enforced by the engine at a model call's STARTED.

Two engine replicas (each its own gRPC server and connection pool) over the one test database share
one quota; calls are admitted in order of arrival; tokens are estimated at STARTED and settled at
COMPLETED; a budget refuses the call that would begin past it, naming max_cost_usd.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from abada.engine.v1 import external_task_pb2_grpc
from abada_engine.api.guard import Guard
from abada_engine.api.server import start_grpc_server
from abada_engine.auth import CallerRegistry
from abada_engine.core import EngineCore
from abada_engine.db.database import create_engine
from abada_engine.runtime.crypto.keys import IdempotencyKeys
from bearer import BearerToken
from engine_helpers import append, deploy, error_info, fetch, journal, start
from google.rpc import error_details_pb2, status_pb2

TOPIC = "abada:agent"
WAITING = re.compile(r"(\d+) call\(s\) waiting before it")


def bundle(profile: str, node_limits: str = "", process_limits: str = "") -> str:
    return f"""
models:
  - {{ name: quota-model, provider: gemini, {profile} }}
processes:
  - id: quota
    start: agent
    {process_limits}
    nodes:
      - id: agent
        type: agent
        model: quota-model
        prompt: p
        result_variable: r
        limits: {{ max_model_calls: 20 {node_limits} }}
        next: done
      - {{ id: done, type: end }}
"""


@dataclass
class Replica:
    tasks: external_task_pb2_grpc.ExternalTaskServiceStub


@pytest.fixture
async def replicas(engine, engine_core, database_url, engine_tokens) -> AsyncIterator[list[Any]]:
    """The suite's engine and a second replica: its own EngineCore, pool and gRPC server, same database
    and the same keys (as replicas must share them)."""
    pool = create_engine(database_url, pool_size=4)
    keys = engine_core.journal.sealer._keys  # the suite's journal keys
    core = await EngineCore.open(pool, database_url, keys, IdempotencyKeys(b"test-idempotency-secret"), None)
    server = await start_grpc_server(core, "127.0.0.1:0", Guard(CallerRegistry(engine_tokens.callers_file)))
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{server.port}", interceptors=[BearerToken(engine_tokens.suite)]
    )
    try:
        yield [engine, Replica(external_task_pb2_grpc.ExternalTaskServiceStub(channel))]
    finally:
        await channel.close()
        await server.stop(0)
        await core.close()
        await pool.dispose()


def retry_delay(error: grpc.aio.AioRpcError) -> float:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.ToMilliseconds() / 1000
    raise AssertionError(f"no RetryInfo on {error.code()}: {error.details()}")


async def started(replica: Any, task: Any, sequence: int = 1, estimate: int = 0) -> Any:
    return await append(
        replica, task, sequence, "MODEL_CALL", "STARTED", request={"turn": 0}, tokens=(estimate, 0)
    )


async def finished(replica: Any, task: Any, sequence: int, tokens: tuple[int, int]) -> Any:
    return await append(
        replica, task, sequence, "MODEL_CALL", "COMPLETED", response={"text": "ok"}, tokens=tokens
    )


async def leased_tasks(engine: Any, count: int) -> list[Any]:
    for _ in range(count):
        await start(engine, "quota")
    tasks = await fetch(engine, "w", TOPIC, max_tasks=count)
    assert len(tasks) == count
    return tasks


async def test_two_replicas_over_one_database_enforce_one_quota(engine, replicas) -> None:
    await deploy(engine, bundle("requests_per_minute: 5"))
    tasks = await leased_tasks(engine, 8)

    # All eight at once, alternating replicas: exactly five get through.
    outcomes = await asyncio.gather(
        *(started(replicas[index % 2], task) for index, task in enumerate(tasks)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(refused) == 3 and len(outcomes) - len(refused) == 5, outcomes
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = error_info(error)
        assert (info.reason, info.metadata["model"], info.metadata["quota"]) == (
            "MODEL_QUOTA_EXHAUSTED",
            "quota-model",
            "requests_per_minute",
        )
        # The window is a minute, plus the engine's margin for the call's way to the provider.
        assert 58 <= retry_delay(error) <= 65.5
    # A refused call was not journaled: its sequence is still free for it to ask again.
    for task, outcome in zip(tasks, outcomes, strict=True):
        steps = await journal(engine, task.id)
        assert len(steps) == (0 if isinstance(outcome, grpc.aio.AioRpcError) else 1)
    # Asking again through the other replica changes nothing before the window moves.
    again = tasks[outcomes.index(refused[0])]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(replicas[1], again)
    assert error_info(caught.value).reason == "MODEL_QUOTA_EXHAUSTED"
    # The same STARTED sent twice (a retried request) is admitted once and counted once.
    admitted = tasks[next(i for i, o in enumerate(outcomes) if not isinstance(o, grpc.aio.AioRpcError))]
    assert (await started(replicas[1], admitted)).step.sequence == 1


async def test_waiting_calls_are_admitted_in_order_of_arrival(engine, replicas) -> None:
    await deploy(engine, bundle("max_concurrent_calls: 1"))
    first, second, third = await leased_tasks(engine, 3)
    await started(replicas[0], first)
    with pytest.raises(grpc.aio.AioRpcError) as second_refused:
        await started(replicas[1], second)
    assert error_info(second_refused.value).metadata["quota"] == "max_concurrent_calls"
    with pytest.raises(grpc.aio.AioRpcError):
        await started(replicas[0], third)

    await finished(replicas[1], first, 1, (10, 5))  # the slot is free again
    # The third asks first, but the second has waited longer: it keeps its turn.
    with pytest.raises(grpc.aio.AioRpcError) as third_again:
        await started(replicas[1], third)
    assert "1 call(s) waiting before it" in third_again.value.details()
    await started(replicas[0], second)
    await finished(replicas[0], second, 1, (10, 5))
    await started(replicas[1], third)


async def test_tokens_are_estimated_at_started_and_settled_at_completed(engine, replicas) -> None:
    await deploy(engine, bundle("tokens_per_minute: 1000"))
    first, second = await leased_tasks(engine, 2)
    await started(replicas[0], first, estimate=600)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(replicas[1], second, estimate=600)
    assert error_info(caught.value).metadata["quota"] == "tokens_per_minute"
    # The call turned out small: its real tokens replace the estimate, and the next one fits.
    await finished(replicas[1], first, 1, (80, 20))
    await started(replicas[0], second, estimate=600)
    # The journal keeps what was spent, never the estimate.
    (step,) = await journal(engine, second.id)
    assert (step.tokens.input_tokens, step.tokens.output_tokens) == (0, 0)


PRICED = "price: { input_per_million_usd: 1000000, output_per_million_usd: 2000000 }"  # $1 in, $2 out


async def test_a_node_budget_refuses_the_call_that_would_begin_past_it_and_shows_the_cost(engine) -> None:
    await deploy(engine, bundle(PRICED, node_limits=", max_cost_usd: 5"))
    (task,) = await leased_tasks(engine, 1)
    await started(engine, task, 1)
    await finished(engine, task, 1, (2, 1))  # $4
    await started(engine, task, 2)  # $4 spent: under the budget, so it may begin
    await finished(engine, task, 2, (1, 1))  # $7
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(engine, task, 3)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = error_info(caught.value)
    assert (info.reason, info.metadata["limit"], info.metadata["scope"]) == (
        "LIMIT_EXCEEDED",
        "max_cost_usd",
        "node",
    )
    assert info.metadata["spent_usd"] == "7.000000"
    assert "max_cost_usd $5" in caught.value.details() and "$7.0" in caught.value.details()
    steps = await journal(engine, task.id)
    assert [s.cost_usd for s in steps] == [4.0, 3.0]


async def test_a_process_budget_counts_every_agent_task_of_the_instance(engine) -> None:
    await deploy(engine, bundle(PRICED, process_limits="limits: { max_cost_usd: 3 }"))
    (task,) = await leased_tasks(engine, 1)
    await started(engine, task, 1)
    await finished(engine, task, 1, (3, 0))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(engine, task, 2)
    info = error_info(caught.value)
    assert (info.metadata["limit"], info.metadata["scope"]) == ("max_cost_usd", "instance")
    assert "process's max_cost_usd $3" in caught.value.details()


async def test_without_a_profile_a_model_runs_unlimited(engine) -> None:
    unprofiled = bundle("requests_per_minute: 1").replace("model: quota-model", "model: gemini-another-model")
    await deploy(engine, unprofiled)
    tasks = await leased_tasks(engine, 3)
    for task in tasks:
        assert (await started(engine, task)).step.sequence == 1


async def test_calls_arriving_together_at_one_replica_are_admitted_and_lined_up_in_turn(
    engine, replicas
) -> None:
    """One replica admits the calls of a model that arrive together in batches: the quota still holds
    exactly, and every refused call is lined up behind the ones refused before it."""
    await deploy(engine, bundle("requests_per_minute: 3"))
    tasks = await leased_tasks(engine, 10)
    outcomes = await asyncio.gather(*(started(replicas[1], task) for task in tasks), return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(refused) == 7, outcomes
    ahead = sorted(int(m.group(1)) if (m := WAITING.search(e.details())) else 0 for e in refused)
    assert ahead == list(range(7)), [e.details() for e in refused]


async def test_the_same_started_sent_twice_at_once_is_admitted_once(engine, replicas) -> None:
    await deploy(engine, bundle("requests_per_minute: 1"))
    first, second = await leased_tasks(engine, 2)
    both = await asyncio.gather(started(replicas[1], first), started(replicas[1], first))
    assert [answer.step.sequence for answer in both] == [1, 1]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await started(replicas[1], second)
    assert error_info(caught.value).metadata["quota"] == "requests_per_minute"
