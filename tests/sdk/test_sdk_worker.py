"""The SDK's Worker as a real process against the real engine: complete, retry, incident, hand-back."""

from __future__ import annotations

import asyncio
import socket
import time

from abada.engine.v1 import external_task_pb2
from abada_engine.api.guard import Guard
from abada_engine.api.server import start_grpc_server
from abada_engine.auth import CallerRegistry
from abada_sdk import InstanceFailed, InstanceState
from sdk_support import poll

BUNDLE = """
processes:
  - id: greet
    start: greet
    nodes:
      - { id: greet, type: service, topic: sdk-greet, next: shout }
      - { id: shout, type: service, topic: sdk-sync, next: done }
      - { id: done, type: end }
  - id: broken
    start: send
    nodes:
      - { id: send, type: service, topic: sdk-broken, retries: 1, retry_backoff_ms: 100, next: done }
      - { id: done, type: end }
  - id: refused
    start: send
    nodes:
      - { id: send, type: service, topic: sdk-refused, next: done }
      - { id: done, type: end }
  - id: slow
    start: wait
    nodes:
      - { id: wait, type: service, topic: sdk-slow, next: done }
      - { id: done, type: end }
  - id: long
    start: work
    nodes:
      - { id: work, type: service, topic: sdk-long, next: done }
      - { id: done, type: end }
  - id: flaky
    start: send
    nodes:
      - { id: send, type: service, topic: sdk-flaky, retries: 1, next: done }
      - { id: done, type: end }
  - id: flaky_short_budget
    start: send
    nodes:
      - { id: send, type: service, topic: sdk-flaky, retries: 1, outage_budget: PT2S, next: done }
      - { id: done, type: end }
"""


async def test_handlers_complete_tasks_with_the_variables_they_return(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address)

    done = await sdk_client.start("greet", {"name": "Alice"}, business_key="order-7", wait=True, timeout=20)

    assert done.state is InstanceState.COMPLETED
    assert done.current_node_id == "done"
    assert done.variables["greeting"] == "hello Alice"
    assert done.variables["seen"] == {"business_key": "order-7", "instance": done.id, "attempt": 1}
    assert done.variables["shouted"] == "ALICE"  # the plain (non-async) handler, run in a thread
    assert [c["event"] for c in worker.calls()] == ["greet", "sync"]
    assert await worker.terminate() == 0


async def test_a_handler_exception_is_retried_with_backoff_then_raised_as_an_incident(
    engine, sdk_client, sdk_worker
):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address)

    handle = await sdk_client.start("broken")
    calls = await worker.wait_for_calls("broken", 2)

    try:
        await handle.result(timeout=20)
    except InstanceFailed as failed:
        incidents = failed.incidents
    else:
        raise AssertionError("the instance completed although its handler always raises")
    assert [(c["attempt"], c["retries_left"]) for c in calls] == [(1, 1), (2, 0)]
    assert [i.type for i in incidents] == ["FAILED_TASK"]
    assert "RuntimeError: the mail server said no (attempt 2)" in incidents[0].message
    history = await sdk_client.history(handle.id)
    failures = [e.data for e in history if e.type == "TASK_FAILED"]
    assert [f["code"] for f in failures] == ["HANDLER_ERROR", "HANDLER_ERROR"]
    assert "Traceback" in failures[0]["details"]["traceback"]
    await asyncio.sleep(0.3)  # a third call would come right after the backoff; there is none
    assert len(worker.calls("broken")) == 2


async def test_task_failed_without_retry_raises_the_incident_at_once(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address)

    handle = await sdk_client.start("refused")
    await worker.wait_for_calls("refused", 1)
    await poll(lambda: _has_incident(sdk_client, handle.id), 20, "the incident")

    [incident] = await sdk_client.incidents(instance_id=handle.id)
    assert incident.type == "BAD_ADDRESS"
    assert incident.message == "the address is invalid"
    assert len(worker.calls("refused")) == 1


async def _has_incident(client, instance_id: str) -> bool:
    return (await client.get(instance_id)).open_incidents > 0


async def test_sigterm_hands_a_running_task_back_without_counting_a_failure(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    # A long lease: had the worker just died, nobody could take the task for a minute.
    worker = await sdk_worker(engine.address, SDK_WORKER_LEASE_MS="60000")
    handle = await sdk_client.start("slow")
    [first] = await worker.wait_for_calls("slow", 1)

    stopped_at = time.monotonic()
    assert await worker.terminate() == 0
    assert "task handed back" in worker.log

    reply = await engine.tasks.FetchAndLock(
        external_task_pb2.FetchAndLockRequest(
            worker_id="sdk-test/next",
            topics=[external_task_pb2.TopicSubscription(name="sdk-slow", lease_ms=30_000)],
            max_tasks=1,
            wait_ms=15_000,
        )
    )
    taken_after = time.monotonic() - stopped_at
    [task] = reply.tasks
    assert task.id == first["task"] and task.instance_id == handle.id
    assert task.attempt == 2
    assert task.retries_left == first["retries_left"]  # handing back is not a failed attempt
    assert taken_after < 15
    history = await sdk_client.history(handle.id)
    assert not [e for e in history if e.type == "TASK_FAILED"]


async def test_the_worker_keeps_the_lease_alive_while_a_handler_runs_longer_than_it(
    engine, sdk_client, sdk_worker
):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address, SDK_WORKER_LEASE_MS="1500")

    done = await sdk_client.start("long", {"seconds": 4}, wait=True, timeout=30)

    assert done.variables["slept"] == 4
    assert [c["attempt"] for c in worker.calls("long")] == [1]  # nobody took it over


async def test_concurrency_bounds_how_many_handlers_run_at_once(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    for _ in range(3):
        await sdk_client.start("slow")
    worker = await sdk_worker(engine.address, SDK_WORKER_CONCURRENCY="2")

    await worker.wait_for_calls("slow", 2)
    await asyncio.sleep(1.5)  # a free slot would be filled within the worker's 1 s poll
    assert len(worker.calls("slow")) == 2
    assert await worker.terminate() == 0


async def test_the_worker_waits_for_an_engine_that_is_not_up_yet(
    engine, engine_core, engine_tokens, sdk_client, sdk_worker
):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = await sdk_worker(f"127.0.0.1:{port}")
    await worker.wait_for_log("cannot fetch tasks")

    late = await start_grpc_server(
        engine_core, f"127.0.0.1:{port}", Guard(CallerRegistry(engine_tokens.callers_file))
    )
    try:
        done = await sdk_client.start("greet", {"name": "Bob"}, wait=True, timeout=30)
        assert done.variables["greeting"] == "hello Bob"
        assert "the engine answers again" in worker.log
    finally:
        await worker.terminate()
        await late.stop(0)


def _calls_answered(method: str) -> float:
    from abada_engine.metrics import REGISTRY

    return (
        REGISTRY.get_sample_value("abada_rpc_duration_seconds_count", {"method": method, "code": "OK"}) or 0.0
    )


async def test_tasks_that_finish_together_are_completed_together(engine, sdk_client, sdk_worker):
    """A busy worker hands its finished tasks back in CompleteTasks calls, many at a time, and every
    task is completed as a Complete would have completed it."""
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    started = [await sdk_client.start("greet", {"name": f"n{i}"}) for i in range(12)]
    singles, batches = _calls_answered("Complete"), _calls_answered("CompleteTasks")
    worker = await sdk_worker(engine.address, SDK_WORKER_CONCURRENCY="12")

    for index, instance in enumerate(started):
        done = await sdk_client.wait(instance.id, timeout=30)
        assert done.state is InstanceState.COMPLETED
        assert done.variables["shouted"] == f"N{index}"
    assert _calls_answered("Complete") == singles  # every task went back in a batch call
    calls = _calls_answered("CompleteTasks") - batches
    assert 1 <= calls <= 12, calls  # 24 tasks (two nodes each): at most one call for two
    assert await worker.terminate() == 0


async def test_a_transient_failure_waits_with_backoff_and_spends_no_retry(engine, sdk_client, sdk_worker):
    """Down for four calls, with one retry on the node: a blip costs time, not the node's retries."""
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address)

    done = await sdk_client.start("flaky", {"outage_calls": 4}, wait=True, timeout=60)

    assert done.state is InstanceState.COMPLETED and done.variables["sent"] is True
    calls = worker.calls("flaky")
    assert [c["retries_left"] for c in calls] == [1] * 5, "a wait spent one of the node's retries"
    history = await sdk_client.history(done.id)
    waits = [e.data for e in history if e.type == "TASK_WAITING"]
    assert len(waits) == 4 and not [e for e in history if e.type == "TASK_FAILED"]
    assert waits[0]["details"]["dependency"] == "smtp"


async def test_a_connection_error_is_transient_too(engine, sdk_client, sdk_worker):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    worker = await sdk_worker(engine.address)

    done = await sdk_client.start("flaky", {"outage_calls": 2, "as": "connection"}, wait=True, timeout=60)

    assert done.state is InstanceState.COMPLETED
    assert [c["retries_left"] for c in worker.calls("flaky")] == [1, 1, 1]
    waits = [e.data for e in await sdk_client.history(done.id) if e.type == "TASK_WAITING"]
    assert [w["code"] for w in waits] == ["UNREACHABLE", "UNREACHABLE"]
    assert "ConnectionRefusedError" in waits[0]["message"]


async def test_past_the_outage_budget_a_transient_failure_is_a_dependency_unavailable_incident(
    engine, sdk_client, sdk_worker
):
    await sdk_client.deploy(BUNDLE, source_name="sdk.yaml")
    await sdk_worker(engine.address)

    handle = await sdk_client.start("flaky_short_budget", {"outage_calls": 1000})
    await poll(lambda: _has_incident(sdk_client, handle.id), 30, "the incident")

    [incident] = await sdk_client.incidents(instance_id=handle.id)
    assert incident.type == "DEPENDENCY_UNAVAILABLE"
    assert "'smtp' has been unavailable" in incident.message
    assert incident.details["dependency"] == "service:smtp"
