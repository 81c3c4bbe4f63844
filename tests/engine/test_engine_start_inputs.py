"""A process may declare its start variables (`inputs:`, a JSON Schema); StartInstance holds callers to it."""

from __future__ import annotations

import pathlib

import grpc
import pytest
from abada.engine.v1 import process_pb2
from engine_helpers import bad_request, deploy, error_info, start, struct

ALICE_BUNDLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "support-triage.yaml"

ORDER = """
processes:
  - id: order
    start: ship
    inputs:
      type: object
      required: [customerId, items]
      properties:
        customerId: { type: string, minLength: 1 }
        items: { type: array, items: { type: integer }, minItems: 1 }
    nodes:
      - { id: ship, type: service, topic: ship, next: done }
      - { id: done, type: end }
"""


async def _refused(engine, **variables) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await start(engine, "order", **variables)
    return caught.value


async def _instances(engine) -> list[process_pb2.Instance]:
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(process_id="order"))
    return list(listed.instances)


async def test_a_start_without_a_required_input_is_refused_naming_it(engine):
    await deploy(engine, ORDER)
    error = await _refused(engine, items=[1])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(error)
    assert info.reason == "VARIABLES_INVALID"
    assert info.metadata["field"] == "variables.customerId"
    assert "variables.customerId: is required by the process's inputs" in error.details()
    assert await _instances(engine) == []


async def test_a_wrongly_typed_input_is_refused_naming_where(engine):
    await deploy(engine, ORDER)
    error = await _refused(engine, customerId="C-42", items=[1, "two"])
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(error).metadata["field"] == "variables.items.1"
    assert "'two' is not of type 'integer'" in error.details()
    assert await _instances(engine) == []


async def test_inputs_that_fit_start_the_instance_with_extra_variables_allowed(engine):
    await deploy(engine, ORDER)
    started = await start(engine, "order", customerId="C-42", items=[1, 2], note="gift")
    assert started.current_node_id == "ship"
    assert [i.id for i in await _instances(engine)] == [started.id]


async def test_a_process_without_inputs_starts_with_any_variables(engine):
    await deploy(
        engine, "processes:\n  - id: free\n    start: done\n    nodes:\n      - { id: done, type: end }\n"
    )
    started = await start(engine, "free", anything=1)
    assert started.state == process_pb2.INSTANCE_STATE_COMPLETED


@pytest.mark.parametrize(
    ("inputs", "why"),
    [
        ("[customerId]", "must be a JSON Schema object, not a list"),
        ("{ type: array }", "its type is object"),
        ("{ type: object, required: 3 }", "not a valid JSON Schema 2020-12"),
    ],
)
async def test_inputs_that_are_not_an_object_schema_are_refused_at_deploy(engine, inputs, why):
    bundle = (
        "processes:\n  - id: bad\n    start: done\n    inputs: "
        + inputs
        + "\n    nodes:\n      - { id: done, type: end }\n"
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert any("processes[0].inputs" in line and why in line for line in bad_request(caught.value)), (
        bad_request(caught.value)
    )


async def test_alice_triage_declares_customer_and_message(engine):
    text = ALICE_BUNDLE.read_text()
    # The CRM need not run: only the start is under test, so the bundle's tool servers are dropped.
    processes = text[text.index("processes:") :].replace(
        "tools: [crm/get_customer, crm/create_ticket]", "tools: []"
    )
    await deploy(engine, processes)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(
                process_id="support_triage", variables=struct({"message": "My parcel never arrived"})
            )
        )
    assert error_info(caught.value).metadata["field"] == "variables.customerId"
