"""The SDK's engine clients (async and sync) against the real engine: typed answers, SDK errors."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from abada.engine.v1 import external_task_pb2
from abada_sdk import (
    AsyncEngineClient,
    EngineClient,
    FailedPrecondition,
    InstanceFailed,
    InstanceState,
    InvalidArgument,
    NotFound,
    Resolution,
    Unauthenticated,
    requests,
)
from engine_helpers import fetch, struct

BUNDLE = """
processes:
  - id: review
    start: check
    nodes:
      - { id: check, type: service, topic: sdk-check, retries: 0, next: approve }
      - { id: approve, type: user_task, next: done }
      - { id: done, type: end }
"""


async def test_deploy_start_get_list_and_cancel(sdk_client):
    deployment = await sdk_client.deploy(BUNDLE, source_name="review.yaml")
    assert [(d.process_id, d.version, d.source_name) for d in deployment.definitions] == [
        ("review", 1, "review.yaml")
    ]
    assert deployment.created_process_ids == ["review"]

    handle = await sdk_client.start("review", {"amount": 12, "who": "Alice"}, business_key="B-1")
    assert handle.started.state is InstanceState.ACTIVE
    assert handle.started.current_node_id == "check"

    found = await sdk_client.get(handle.id)
    assert found.variables == {"amount": 12, "who": "Alice"}
    assert found.business_key == "B-1"
    listed = await sdk_client.list_instances("review", InstanceState.ACTIVE)
    assert [i.id for i in listed] == [handle.id]

    canceled = await sdk_client.cancel(handle.id, reason="testing")
    assert canceled.state is InstanceState.CANCELED
    with pytest.raises(InstanceFailed, match="canceled"):
        await handle.result(timeout=5)
    assert await sdk_client.list_instances("review", InstanceState.ACTIVE) == []


async def test_the_instances_a_call_activity_started_are_listed_by_their_parent(sdk_client):
    await sdk_client.deploy(
        BUNDLE
        + """
  - id: calls_review
    start: call_review
    nodes:
      - { id: call_review, type: call, process: review, next: done }
      - { id: done, type: end }
"""
    )
    parent = await sdk_client.start("calls_review", {"amount": 3})
    [child] = await sdk_client.list_instances(parent_instance_id=parent.id)
    assert child.process_id == "review" and child.parent_instance_id == parent.id
    assert child.variables == {"amount": 3}
    assert (await sdk_client.get(parent.id)).parent_instance_id == ""


async def test_result_waits_through_a_user_task_and_returns_the_completed_instance(engine, sdk_client):
    await sdk_client.deploy(BUNDLE)
    handle = await sdk_client.start("review", {"amount": 12})
    waiting = asyncio.create_task(handle.result(timeout=20))

    [task] = await fetch(engine, "sdk-test", "sdk-check")
    await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="sdk-test",
            lease_token=task.lease_token,
            variables=struct({"ok": True}),
        )
    )
    [user_task] = await _poll_user_tasks(sdk_client, handle.id)
    assert user_task.node_id == "approve"
    assert not waiting.done()
    await sdk_client.complete_user_task(user_task.id, {"approved": True})

    done = await waiting
    assert done.state is InstanceState.COMPLETED and done.current_node_id == "done"
    assert done.variables == {"amount": 12, "ok": True, "approved": True}
    assert [e.type for e in await sdk_client.history(handle.id)][-1] == "INSTANCE_COMPLETED"


async def _poll_user_tasks(client, instance_id):
    for _ in range(100):
        found = await client.user_tasks(instance_id)
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError("no user task appeared")


async def test_an_incident_ends_the_wait_and_can_be_resolved(engine, sdk_client):
    await sdk_client.deploy(BUNDLE)
    handle = await sdk_client.start("review")
    [task] = await fetch(engine, "sdk-test", "sdk-check")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id, worker_id="sdk-test", lease_token=task.lease_token, error_message="smtp down"
        )
    )
    with pytest.raises(InstanceFailed) as failed:
        await handle.result(timeout=10)
    [incident] = failed.value.incidents
    assert incident.type == "FAILED_TASK" and incident.task_id == task.id and "smtp down" in incident.message

    resolved = await sdk_client.resolve_incident(incident.id, Resolution.RETRY, comment="smtp is back")
    assert not resolved.open
    assert await sdk_client.incidents(instance_id=handle.id) == []
    assert [i.id for i in await sdk_client.incidents(instance_id=handle.id, include_resolved=True)] == [
        incident.id
    ]


async def test_refusals_are_sdk_errors_with_the_engine_reason(engine, engine_tokens, sdk_client):
    with pytest.raises(NotFound) as missing:
        await sdk_client.start("no_such_process")
    assert missing.value.reason == "NOT_FOUND"

    with pytest.raises(InvalidArgument) as bad:
        await sdk_client.deploy(
            "processes:\n  - id: broken\n    start: nowhere\n    nodes: []\n", source_name="b.yaml"
        )
    assert bad.value.reason == "DEFINITION_INVALID" and bad.value.field
    assert any("b.yaml" in violation for violation in bad.value.violations)

    async with AsyncEngineClient(engine.address, token="not-a-known-token") as stranger:
        with pytest.raises(Unauthenticated):
            await stranger.list_instances()


async def test_the_journal_of_a_task(engine, sdk_client):
    await sdk_client.deploy(
        "processes:\n  - id: thinker\n    start: think\n    nodes:\n"
        "      - { id: think, type: agent, model: gemini-m, prompt: hi, result_variable: r, next: done }\n"
        "      - { id: done, type: end }\n"
    )
    await sdk_client.start("thinker")
    [task] = await fetch(engine, "sdk-test", "abada:agent")
    await engine.tasks.AppendStep(
        external_task_pb2.AppendStepRequest(
            task_id=task.id,
            worker_id="sdk-test",
            lease_token=task.lease_token,
            attempt=task.attempt,
            sequence=1,
            kind=external_task_pb2.STEP_KIND_MODEL_CALL,
            state=external_task_pb2.STEP_STATE_STARTED,
            request=struct({"turn": 1}),
        )
    )
    [step] = await sdk_client.journal(task.id)
    assert (step.sequence, step.kind, step.state, step.request) == (1, "MODEL_CALL", "STARTED", {"turn": 1})


async def test_the_sync_client_from_plain_code(engine, engine_tokens):
    def script() -> tuple[str, InstanceState, str]:
        with EngineClient(engine.address, token=engine_tokens.suite, timeout=10) as client:
            client.deploy(BUNDLE)
            handle = client.start("review", {"amount": 3})
            canceled = client.cancel(handle.id)
            try:
                client.start("nope")
            except NotFound as error:
                reason = error.reason
            return handle.id, canceled.state, reason

    # The test engine serves on this loop, so the blocking client runs in a thread, as user code would.
    instance_id, state, reason = await asyncio.to_thread(script)
    assert instance_id and state is InstanceState.CANCELED and reason == "NOT_FOUND"


async def test_iterating_instances_follows_the_page_tokens(sdk_client):
    await sdk_client.deploy(BUNDLE, source_name="review.yaml")
    started = [(await sdk_client.start("review", {}, business_key=f"K-{n % 2}")).id for n in range(7)]

    walked = [i.id async for i in sdk_client.iter_instances("review", page_size=2)]
    assert walked == started[::-1], "every instance once, newest first, across four pages"
    keyed = [i.id async for i in sdk_client.iter_instances(business_key="K-1", page_size=2)]
    assert keyed == started[1::2][::-1]
    assert [i.id for i in await sdk_client.list_instances("review", limit=3)] == started[::-1][:3]


async def test_what_operators_watch_and_resolving_incidents_by_the_hundred(engine, engine_tokens, sdk_client):
    await sdk_client.deploy(BUNDLE)
    held = [(await sdk_client.start("review", {"n": n})).id for n in range(2)]
    waiting = (await sdk_client.start("review", {"n": 2})).id
    for task in await fetch(engine, "sdk-test", "sdk-check", max_tasks=2):
        await engine.tasks.Fail(
            external_task_pb2.FailRequest(
                task_id=task.id, worker_id="sdk-test", lease_token=task.lease_token, error_message="down"
            )
        )
    [topic] = [t for t in (await sdk_client.topics()).topics if t.name == "sdk-check"]
    assert (topic.ready, topic.leased) == (1, 0)
    assert await sdk_client.dependencies() == [], "no worker reported a dependency"

    outcome = await sdk_client.resolve_incidents(
        "FAILED_TASK", Resolution.CANCEL_INSTANCE, process_id="review", comment="cleanup"
    )
    assert sorted(i.instance_id for i in outcome.resolved) == sorted(held)
    assert (list(outcome.refused), outcome.remaining) == ([], 0)
    assert {(await sdk_client.get(i)).state for i in held} == {InstanceState.CANCELED}

    def open_tasks() -> list[str]:
        # The sync client answers any call the typed methods leave out with the engine's own reply.
        with EngineClient(engine.address, token=engine_tokens.suite, timeout=10) as client:
            reply = client.call(lambda stubs: stubs.queue.ListTasks, requests.list_open_tasks("sdk-check"))
            return [task.instance_id for task in reply.tasks]

    assert await asyncio.to_thread(open_tasks) == [waiting]


async def test_a_start_with_a_request_id_sent_again_is_the_first_start(sdk_client):
    await sdk_client.deploy(BUNDLE)
    first = await sdk_client.start("review", {"amount": 1}, request_id="delivery-9")
    again = await sdk_client.start("review", {"amount": 2}, request_id="delivery-9")
    assert not first.already_started
    assert again.already_started
    assert again.id == first.id
    assert again.started.variables == {"amount": 1}


async def test_instances_are_listed_by_a_variables_value(sdk_client):
    await sdk_client.deploy(BUNDLE)
    alice = await sdk_client.start("review", {"customerId": "C-42"})
    await sdk_client.start("review", {"customerId": "C-43"})
    found = await sdk_client.list_instances("review", where={"customerId": "C-42"})
    assert [i.id for i in found] == [alice.id]


WAITS_FOR_A_REPLY = """
processes:
  - id: replied
    start: wait
    nodes:
      - { id: wait, type: receive, message: customer_reply, correlation_key: "${ticket}", result_variable: reply, next: done }
      - { id: done, type: end }
"""


async def test_a_message_is_published_once_to_the_instance_waiting_for_it(sdk_client):
    await sdk_client.deploy(WAITS_FOR_A_REPLY)
    waiting = await sdk_client.start("replied", {"ticket": "T-1"})
    # A message_id is remembered for the message's ttl (none without one, as in Zeebe).
    hour = timedelta(hours=1)
    sent = await sdk_client.publish(
        "customer_reply", "T-1", {"text": "thanks"}, ttl=hour, message_id="hook-1"
    )
    assert (sent.correlated, sent.instance_id, sent.duplicate) == (True, waiting.id, False)
    again = await sdk_client.publish(
        "customer_reply", "T-1", {"text": "thanks"}, ttl=hour, message_id="hook-1"
    )
    assert again.duplicate and again.message_key == sent.message_key
    done = await waiting.result(timeout=10)
    assert done.variables["reply"] == {"text": "thanks"}
    buffered = await sdk_client.publish("customer_reply", "T-2", ttl=timedelta(minutes=5))
    assert not buffered.correlated and buffered.instance_id == ""


async def test_erasing_a_customer_and_purging_what_ended(sdk_client):
    await sdk_client.deploy(BUNDLE)
    await sdk_client.start("review", {"customerId": "C-42"}, business_key="C-42")
    other = await sdk_client.start("review", {"customerId": "C-43"})
    with pytest.raises(FailedPrecondition) as refused:
        await sdk_client.erase(where={"customerId": "C-42"})
    assert refused.value.reason == "INSTANCES_ACTIVE"
    erased = await sdk_client.erase("C-42", cancel_active=True)
    assert (erased.instances, erased.canceled) == (1, 1) and erased.erasure_id
    assert [i.id for i in await sdk_client.list_instances("review")] == [other.id]
    await sdk_client.cancel(other.id)
    now = datetime.now(UTC) + timedelta(seconds=1)
    assert (await sdk_client.purge(now, "review", dry_run=True)).instances == 1
    assert (await sdk_client.purge(now, "review")).instances == 1
    assert await sdk_client.list_instances("review") == []
