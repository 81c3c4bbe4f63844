"""Starts that happen once: a start's request id answers a re-sent start with the first instance, and a
process may take one active instance per business key."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from abada.engine.v1 import process_pb2
from engine_helpers import complete, deploy, error_info, fetch, instance, struct, upkeep_round
from sqlalchemy import text

BUNDLE = """
processes:
  - id: refund
    start: pay
    nodes:
      - { id: pay, type: service, topic: pay, next: done }
      - { id: done, type: end }
  - id: case
    unique_business_key: true
    start: handle
    nodes:
      - { id: handle, type: service, topic: handle, next: done }
      - { id: done, type: end }
"""


async def _start(engine, process_id: str, business_key: str = "", request_id: str = "", **variables):
    return await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id=process_id,
            variables=struct(variables),
            business_key=business_key,
            request_id=request_id,
        )
    )


async def _count(engine, process_id: str) -> int:
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(process_id=process_id))
    return len(listed.instances)


async def test_a_start_sent_again_with_its_request_id_answers_the_first_instance(engine):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "refund", request_id="webhook-delivery-17", amount=10)
    again = await _start(engine, "refund", request_id="webhook-delivery-17", amount=99)
    assert not first.already_started
    assert again.already_started
    assert again.instance.id == first.instance.id
    # The first start's variables, not the re-sent ones: nothing of the second start was written.
    assert again.instance.variables["amount"] == 10
    assert await _count(engine, "refund") == 1
    assert len(await fetch(engine, "w", "pay", max_tasks=5)) == 1
    other = await _start(engine, "refund", request_id="webhook-delivery-18", amount=10)
    assert other.instance.id != first.instance.id


async def test_concurrent_starts_with_one_request_id_start_one_instance(engine):
    await deploy(engine, BUNDLE)
    answers = await asyncio.gather(*(_start(engine, "refund", request_id="burst") for _ in range(20)))
    assert len({a.instance.id for a in answers}) == 1
    assert sum(not a.already_started for a in answers) == 1
    assert await _count(engine, "refund") == 1


async def test_a_request_id_is_answered_after_its_instance_finished(engine):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "refund", request_id="r-1")
    (task,) = await fetch(engine, "w", "pay")
    await complete(engine, task, "w", {})
    again = await _start(engine, "refund", request_id="r-1")
    assert again.already_started
    assert again.instance.id == first.instance.id
    assert again.instance.state == process_pb2.INSTANCE_STATE_COMPLETED


async def test_a_request_id_older_than_a_day_starts_anew_and_upkeep_lets_it_go(engine, db):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "refund", request_id="old")
    await _start(engine, "refund", request_id="older")
    async with db.begin() as conn:
        await conn.execute(text("UPDATE start_requests SET created_at = now() - interval '25 hours'"))
    anew = await _start(engine, "refund", request_id="old")
    assert not anew.already_started
    assert anew.instance.id != first.instance.id
    await upkeep_round(db)
    async with db.connect() as conn:
        kept = (await conn.execute(text("SELECT request_id FROM start_requests"))).scalars().all()
    assert kept == ["old"]


async def test_an_overlong_request_id_is_refused_naming_the_field(engine):
    await deploy(engine, BUNDLE)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _start(engine, "refund", request_id="x" * 201)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "request_id"
    assert await _count(engine, "refund") == 0


async def test_a_unique_business_key_held_by_an_active_instance_is_refused_naming_it(engine):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "case", business_key="C-42")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _start(engine, "case", business_key="C-42")
    error = caught.value
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    info = error_info(error)
    assert info.reason == "BUSINESS_KEY_ACTIVE"
    assert info.metadata["instance_id"] == first.instance.id
    assert first.instance.id in error.details()
    # Another key, and another process with the same key, start as usual.
    await _start(engine, "case", business_key="C-43")
    await _start(engine, "refund", business_key="C-42")
    await _start(engine, "refund", business_key="C-42")
    assert await _count(engine, "case") == 2


async def test_a_unique_business_key_is_free_again_once_its_instance_ends(engine):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "case", business_key="C-42")
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=first.instance.id, reason="test")
    )
    second = await _start(engine, "case", business_key="C-42")
    assert second.instance.id != first.instance.id
    assert (await instance(engine, second.instance.id)).state == process_pb2.INSTANCE_STATE_ACTIVE


async def test_concurrent_starts_with_one_unique_key_leave_one_active_instance(engine):
    await deploy(engine, BUNDLE)
    answers = await asyncio.gather(
        *(_start(engine, "case", business_key="C-7") for _ in range(10)), return_exceptions=True
    )
    started = [a for a in answers if not isinstance(a, BaseException)]
    refused = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert len(started) == 1
    assert len(refused) == 9
    assert {error_info(e).metadata["instance_id"] for e in refused} == {started[0].instance.id}


async def test_a_unique_key_process_needs_a_business_key(engine):
    await deploy(engine, BUNDLE)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _start(engine, "case")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "business_key"


async def test_a_request_id_and_a_held_key_answer_the_first_start_not_a_refusal(engine):
    await deploy(engine, BUNDLE)
    first = await _start(engine, "case", business_key="C-1", request_id="hook-1")
    again = await _start(engine, "case", business_key="C-1", request_id="hook-1")
    assert again.already_started and again.instance.id == first.instance.id
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _start(engine, "case", business_key="C-1", request_id="hook-2")
    assert error_info(caught.value).reason == "BUSINESS_KEY_ACTIVE"
    # The refused start's request id was not kept: once the key is free, it starts.
    await engine.processes.CancelInstance(
        process_pb2.CancelInstanceRequest(instance_id=first.instance.id, reason="test")
    )
    assert not (await _start(engine, "case", business_key="C-1", request_id="hook-2")).already_started
