"""Text PostgreSQL cannot store (a NUL character) is refused as bad input naming the field, and loses nothing."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import GREET, deploy, error_info, fetch, start, struct
from sqlalchemy import text


async def test_a_nul_character_is_refused_naming_the_field_and_nothing_is_written(engine, db):
    await deploy(engine, GREET)
    for request, field in (
        (process_pb2.StartInstanceRequest(process_id="greet", business_key="order\x00-1"), "business_key"),
        (
            process_pb2.StartInstanceRequest(process_id="greet", variables=struct({"note": "a\x00b"})),
            "variables",
        ),
        (process_pb2.StartInstanceRequest(process_id="greet", variables=struct({"a\x00": 1})), "variables"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await engine.processes.StartInstance(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value).metadata["field"] == field
        assert "NUL" in caught.value.details()
    # Text that only spells an escape is ordinary text.
    spelled = await start(engine, "greet", note="\\u0000 is how JSON writes NUL")
    assert spelled.variables["note"] == "\\u0000 is how JSON writes NUL"
    async with db.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM instances"))).scalar() == 1


async def test_a_character_the_database_refuses_where_no_check_names_it_is_invalid_argument(engine):
    await deploy(engine, GREET)
    await start(engine, "greet")
    [task] = await fetch(engine, "w", "greetings")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.tasks.Fail(
            external_task_pb2.FailRequest(
                task_id=task.id, worker_id="w", lease_token=task.lease_token, error_message="broke\x00"
            )
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NUL" in caught.value.details()
    # The task is as it was: still leased to the worker, which can fail it properly.
    failed = await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id, worker_id="w", lease_token=task.lease_token, error_message="broke"
        )
    )
    assert failed.will_retry


async def test_a_number_json_cannot_carry_is_refused_naming_the_field(engine):
    await deploy(engine, GREET)
    for number in (float("nan"), float("inf")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await engine.processes.StartInstance(
                process_pb2.StartInstanceRequest(process_id="greet", variables=struct({"score": number}))
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value).metadata["field"] == "variables"
    whole = await start(engine, "greet", count=3, ratio=0.5, big=2.0**60)
    assert (whole.variables["count"], whole.variables["ratio"], whole.variables["big"]) == (3, 0.5, 2.0**60)
