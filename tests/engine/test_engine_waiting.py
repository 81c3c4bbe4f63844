"""Waiting on the world: timer nodes, receive nodes with published messages, deadlines."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import httpx2
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2, process_pb2_grpc
from bearer import BearerToken
from engine_helpers import (
    append,
    complete,
    deploy,
    error_info,
    fetch,
    history_types,
    instance,
    journal,
    plain,
    start,
    struct,
    verify_lease,
)
from google.protobuf import duration_pb2
from sqlalchemy import text

FLOWS = """
processes:
  - id: pause
    start: wait
    nodes:
      - { id: wait, type: timer, duration: PT1S, next: after }
      - { id: after, type: service, topic: after-pause, next: done }
      - { id: done, type: end }
  - id: pause_until
    start: wait
    nodes:
      - { id: wait, type: timer, until: "${when}", next: done }
      - { id: done, type: end }
  - id: reply
    start: await_reply
    nodes:
      - id: await_reply
        type: receive
        message: customer_reply
        correlation_key: "${ticket.id}"
        result_variable: reply
        timeout: PT2S
        on_timeout: escalate
        next: done
      - { id: escalate, type: service, topic: escalations, next: done }
      - { id: done, type: end }
  - id: merged
    start: await_payment
    nodes:
      - { id: await_payment, type: receive, message: payment, correlation_key: "${order}", next: done }
      - { id: done, type: end }
  - id: slow_service
    start: work
    nodes:
      - { id: work, type: service, topic: slow-work, deadline: PT1S, on_deadline: too_late, next: done }
      - { id: too_late, type: service, topic: too-late, next: done }
      - { id: done, type: end }
"""


async def publish(engine: Any, name: str, key: str, ttl: str = "", message_id: str = "", **variables: Any):
    request = process_pb2.PublishMessageRequest(
        name=name, correlation_key=key, variables=struct(variables), message_id=message_id
    )
    if ttl:
        request.ttl.CopyFrom(duration_pb2.Duration(seconds=int(ttl)))
    return await engine.processes.PublishMessage(request)


async def until_at(engine: Any, instance_id: str, node_id: str, timeout: float = 5.0) -> process_pb2.Instance:
    deadline = time.monotonic() + timeout
    while True:
        found = await instance(engine, instance_id)
        if found.current_node_id == node_id or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.05)


async def test_a_timer_waits_its_duration_then_moves_on_once(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "pause")
    assert started.current_node_id == "wait"
    [waiting] = (await instance(engine, started.id)).waits
    assert waiting.kind == process_pb2.Wait.KIND_TIMER and not waiting.HasField("fire_time")
    assert await fetch(engine, "w", "after-pause") == []

    moved = await until_at(engine, started.id, "after")
    assert moved.current_node_id == "after"
    [fired] = (await instance(engine, started.id)).waits
    late = fired.fire_time.ToDatetime() - fired.due_time.ToDatetime()
    assert 0 <= late.total_seconds() < 1.0
    due_after = fired.due_time.ToDatetime() - started.create_time.ToDatetime()
    assert 0.9 <= due_after.total_seconds() < 1.5
    assert [t for t, _ in await history_types(engine, started.id)].count("TIMER_FIRED") == 1
    assert len(await fetch(engine, "w", "after-pause")) == 1


async def test_a_timer_until_a_time_in_the_variables(engine):
    await deploy(engine, FLOWS)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 1))
    started = await start(engine, "pause_until", when=when)
    assert started.current_node_id == "wait"
    done = await until_at(engine, started.id, "done", timeout=4)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_an_until_that_is_not_a_time_raises_an_incident(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "pause_until", when="tomorrow morning")
    assert started.open_incidents == 1


async def test_a_message_published_after_the_instance_waits_correlates_at_once(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "reply", ticket={"id": "T-1"})
    assert started.current_node_id == "await_reply"
    listed = await engine.processes.ListInstances(
        process_pb2.ListInstancesRequest(waiting_for=process_pb2.WAITING_FOR_MESSAGE)
    )
    assert [i.id for i in listed.instances] == [started.id]

    answer = await publish(engine, "customer_reply", "T-1", text="thanks, it arrived")
    assert answer.correlated and answer.instance_id == started.id and not answer.duplicate
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain(done.variables)["reply"] == {"text": "thanks, it arrived"}
    assert ("MESSAGE_RECEIVED", "await_reply") in await history_types(engine, started.id)


async def test_a_message_published_before_is_buffered_and_taken_by_the_first_instance(engine):
    await deploy(engine, FLOWS)
    answer = await publish(engine, "payment", "O-7", ttl="30", amount=12)
    assert not answer.correlated and answer.instance_id == ""
    first = await start(engine, "merged", order="O-7")
    second = await start(engine, "merged", order="O-7")
    first = await until_at(engine, first.id, "done")
    assert first.state == process_pb2.INSTANCE_STATE_COMPLETED
    # Merged at the top level: no result_variable.
    assert plain(first.variables) == {"order": "O-7", "amount": 12}
    await asyncio.sleep(0.3)
    assert (await instance(engine, second.id)).current_node_id == "await_payment"


async def test_the_oldest_waiting_receive_takes_the_message(engine):
    await deploy(engine, FLOWS)
    older = await start(engine, "merged", order="O-1")
    newer = await start(engine, "merged", order="O-1")
    other = await start(engine, "merged", order="O-2")
    answer = await publish(engine, "payment", "O-1")
    assert answer.instance_id == older.id
    assert (await instance(engine, newer.id)).current_node_id == "await_payment"
    assert (await instance(engine, other.id)).current_node_id == "await_payment"


async def test_a_duplicate_message_id_is_answered_with_the_first_publication(engine):
    await deploy(engine, FLOWS)
    first_instance = await start(engine, "merged", order="O-3")
    second_instance = await start(engine, "merged", order="O-3")
    first = await publish(engine, "payment", "O-3", ttl="60", message_id="webhook-41", amount=1)
    again = await publish(engine, "payment", "O-3", ttl="60", message_id="webhook-41", amount=1)
    assert first.instance_id == first_instance.id and not first.duplicate
    assert again.duplicate and again.message_key == first.message_key
    assert again.instance_id == first_instance.id
    await asyncio.sleep(0.3)
    assert (await instance(engine, second_instance.id)).current_node_id == "await_payment"


async def test_a_message_past_its_ttl_is_gone(engine, engine_core):
    await deploy(engine, FLOWS)
    answer = await publish(engine, "payment", "O-9", ttl="1", message_id="once")
    assert not answer.correlated
    await asyncio.sleep(1.2)
    started = await start(engine, "merged", order="O-9")
    await engine_core.waits.correlate_buffered()
    assert (await instance(engine, started.id)).current_node_id == "await_payment"
    # Its id is forgotten with it: the same id publishes anew.
    again = await publish(engine, "payment", "O-9", ttl="1", message_id="once")
    assert not again.duplicate and again.instance_id == started.id


async def test_a_receive_that_hears_nothing_times_out_to_on_timeout(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "reply", ticket={"id": "T-2"})
    moved = await until_at(engine, started.id, "escalate", timeout=5)
    assert moved.current_node_id == "escalate"
    types = [t for t, _ in await history_types(engine, started.id)]
    assert "MESSAGE_TIMED_OUT" in types and "MESSAGE_RECEIVED" not in types
    # Too late now: the message is buffered, not given to the instance that moved on.
    answer = await publish(engine, "customer_reply", "T-2", ttl="5")
    assert not answer.correlated


async def test_a_deadline_withdraws_the_task_and_takes_on_deadline(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "slow_service")
    [task] = await fetch(engine, "w", "slow-work")
    moved = await until_at(engine, started.id, "too_late", timeout=5)
    assert moved.current_node_id == "too_late"
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await complete(engine, task, "w", {})
    assert error_info(refused.value).reason == "TASK_NOT_LEASED"
    history = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    [passed] = [e for e in history.events if e.type == "DEADLINE_PASSED"]
    assert passed.node_id == "work" and plain(passed.data)["deadline_seconds"] == 1
    kinds = {w.kind for w in moved.waits}
    assert process_pb2.Wait.KIND_DEADLINE in kinds


async def test_a_deadline_that_passes_after_the_task_finished_fires_into_nothing(engine):
    await deploy(engine, FLOWS)
    started = await start(engine, "slow_service")
    [task] = await fetch(engine, "w", "slow-work")
    await complete(engine, task, "w", {})
    await asyncio.sleep(1.3)
    done = await instance(engine, started.id)
    assert done.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert "DEADLINE_PASSED" not in [t for t, _ in await history_types(engine, started.id)]


AGENT = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      get_customer: {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: none }}
processes:
  - id: timed_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Open a ticket for ${{customerId}}.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        deadline: PT1.5S
        on_deadline: review
        next: done
      - {{ id: review, type: user_task, next: done }}
      - {{ id: done, type: end }}
"""


async def test_a_deadline_mid_turn_withdraws_the_agent_task_and_its_write_becomes_outcome_unknown(
    engine, crm_credentials
):
    await deploy(engine, AGENT.format(url=crm_credentials.url))
    started = await start(engine, "timed_triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent")
    ticket = {"callId": "call_0", "name": "crm__create_ticket", "arguments": {"customerId": "C-42"}}
    await append(engine, task, 1, "TOOL_CALL", "STARTED", tool_ref="crm/create_ticket", request=ticket)

    moved = await until_at(engine, started.id, "review", timeout=5)
    assert moved.current_node_id == "review"

    # The worker's next append and its credential request are refused: the lease is gone.
    with pytest.raises(grpc.aio.AioRpcError) as appended:
        await append(
            engine,
            task,
            1,
            "TOOL_CALL",
            "COMPLETED",
            tool_ref="crm/create_ticket",
            request=ticket,
            response={},
        )
    assert error_info(appended.value).reason == "TASK_NOT_LEASED"
    with pytest.raises(grpc.aio.AioRpcError) as credential:
        await verify_lease(engine, task)
    assert credential.value.code() == grpc.StatusCode.PERMISSION_DENIED

    [step] = await journal(engine, task.id)
    assert step.state == external_task_pb2.STEP_STATE_OUTCOME_UNKNOWN
    history = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    types = [e.type for e in history.events]
    assert types.index("DEADLINE_PASSED") < types.index("USER_TASK_CREATED")
    [unknown] = [plain(e.data) for e in history.events if e.type == "STEP_OUTCOME_UNKNOWN"]
    assert (unknown["sequence"], unknown["tool_ref"]) == (1, "crm/create_ticket")


async def test_a_publisher_publishes_only_the_messages_it_is_named_for(engine, engine_tokens):
    await deploy(engine, FLOWS)
    waiting = await start(engine, "reply", ticket={"id": "T-5"})
    async with grpc.aio.insecure_channel(
        engine.address, interceptors=[BearerToken(engine_tokens.publisher)]
    ) as channel:
        helpdesk = process_pb2_grpc.ProcessServiceStub(channel)
        answer = await helpdesk.PublishMessage(
            process_pb2.PublishMessageRequest(name="customer_reply", correlation_key="T-5")
        )
        assert answer.instance_id == waiting.id
        with pytest.raises(grpc.aio.AioRpcError) as other_name:
            await helpdesk.PublishMessage(
                process_pb2.PublishMessageRequest(name="payment", correlation_key="O-1")
            )
        assert other_name.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(other_name.value).reason == "MESSAGE_NOT_ALLOWED"
        with pytest.raises(grpc.aio.AioRpcError) as starting:
            await helpdesk.StartInstance(process_pb2.StartInstanceRequest(process_id="reply"))
        assert error_info(starting.value).reason == "ROLE_REQUIRED"


async def test_a_webhook_publishes_over_http_and_a_resend_is_answered_with_the_first(
    engine, engine_http, engine_tokens
):
    await deploy(engine, FLOWS)
    waiting = await start(engine, "reply", ticket={"id": "T-8"})
    headers = {"authorization": f"Bearer {engine_tokens.publisher}"}
    async with httpx2.AsyncClient(base_url=engine_http, headers=headers) as client:
        listed = await client.get("/v1/instances", params={"waitingFor": "MESSAGE"})
        assert listed.status_code == 403  # a publisher publishes, and reads nothing
        body = {"name": "customer_reply", "correlationKey": "T-8", "ttl": "3600s", "messageId": "hook-1"}
        first = await client.post("/v1/messages:publish", json={**body, "variables": {"text": "yes"}})
        again = await client.post("/v1/messages:publish", json={**body, "variables": {"text": "yes"}})
    assert first.status_code == 200, first.text
    assert first.json()["instanceId"] == waiting.id and first.json()["correlated"] is True
    assert again.json()["duplicate"] is True and again.json()["messageKey"] == first.json()["messageKey"]
    assert plain((await instance(engine, waiting.id)).variables)["reply"] == {"text": "yes"}


async def test_a_step_begun_while_its_task_is_being_withdrawn_waits_and_is_refused(
    engine, db, crm_credentials
):
    """A withdrawal (a deadline, a cancel) updates the task row, then reads the journal for writes in
    flight: a STARTED write racing it must not be checked against the row as it was before and land
    after that read, unseen. Here the withdrawal is held open between the two."""
    await deploy(engine, AGENT.format(url=crm_credentials.url))
    await start(engine, "timed_triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent")
    ticket = {"callId": "call_0", "name": "crm__create_ticket", "arguments": {"customerId": "C-42"}}
    async with db.connect() as conn:
        withdrawal = await conn.begin()
        await conn.execute(
            text("UPDATE tasks SET state = 'CANCELED', lease_token_hash = NULL WHERE id = :id"),
            {"id": task.id},
        )
        begun = asyncio.create_task(
            append(engine, task, 1, "TOOL_CALL", "STARTED", tool_ref="crm/create_ticket", request=ticket)
        )
        await asyncio.sleep(0.5)
        assert not begun.done(), "the write was checked against the task row as it was"
        await withdrawal.commit()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await begun
    assert error_info(caught.value).reason == "TASK_NOT_LEASED"
    assert await journal(engine, task.id) == []
