"""Model profiles in the bundle: validated like the rest, frozen with the definition version."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import definition_pb2
from engine_helpers import deploy, error_info, start
from google.protobuf import json_format

PROFILED = """
models:
  - name: gemini-3.6-flash
    provider: gemini
    requests_per_minute: 40
    tokens_per_minute: 200000
    max_concurrent_calls: 8
    price: { input_per_million_usd: 0.30, output_per_million_usd: 2.50 }
processes:
  - id: triage
    start: agent
    limits: { max_cost_usd: 2.5 }
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Triage ${message}
        result_variable: triage
        limits: { max_model_calls: 4, max_cost_usd: 0.05 }
        next: done
      - { id: done, type: end }
"""


async def _frozen_spec(engine, process_id: str, version: int = 0) -> dict:
    got = await engine.definitions.GetDefinition(
        definition_pb2.GetDefinitionRequest(process_id=process_id, version=version)
    )
    return json_format.MessageToDict(got.definition.spec)


async def test_profile_and_budgets_are_frozen_with_the_version(engine):
    first = await deploy(engine, PROFILED, "triage.yaml")
    assert first.definitions[0].version == 1
    spec = await _frozen_spec(engine, "triage")
    assert spec["models"] == [
        {
            "name": "gemini-3.6-flash",
            "provider": "gemini",
            "requests_per_minute": 40,
            "tokens_per_minute": 200000,
            "max_concurrent_calls": 8,
            "price": {"input_per_million_usd": 0.3, "output_per_million_usd": 2.5},
        }
    ]
    assert spec["limits"] == {"max_cost_usd": 2.5}
    assert spec["nodes"][0]["limits"]["max_cost_usd"] == 0.05
    old = await start(engine, "triage", message="hi")

    # A new price is a new version; the instance already running keeps the profile it started with.
    await deploy(engine, PROFILED.replace("output_per_million_usd: 2.50", "output_per_million_usd: 3.00"))
    assert (await _frozen_spec(engine, "triage"))["models"][0]["price"]["output_per_million_usd"] == 3.0
    assert (await _frozen_spec(engine, "triage", old.version))["models"][0]["price"][
        "output_per_million_usd"
    ] == 2.5

    # The same bundle again is the same version: profiles are part of the content digest.
    again = await deploy(
        engine, PROFILED.replace("output_per_million_usd: 2.50", "output_per_million_usd: 3.00")
    )
    assert (again.definitions[0].version, list(again.created_process_ids)) == (2, [])


async def test_profiles_a_process_does_not_use_are_not_frozen_into_it(engine):
    unused = PROFILED.replace("model: gemini-3.6-flash", "model: gemini-other-model").replace(
        ", max_cost_usd: 0.05", ""
    )
    await deploy(engine, unused)
    spec = await _frozen_spec(engine, "triage")
    assert "models" not in spec  # the node's model names no profile: it runs unlimited, as before


@pytest.mark.parametrize(
    ("old", "new", "field", "line", "why"),
    [
        ("provider: gemini", "provider: hal9000", "models[0].provider", 4, "is not one of: gemini"),
        ("requests_per_minute: 40", "requests_per_minute: 0", "models[0].requests_per_minute", 5, ">= 1"),
        ("tokens_per_minute: 200000", "tokens_per_minute: lots", "models[0].tokens_per_minute", 6, "integer"),
        ("max_concurrent_calls: 8", "max_concurrents: 8", "models[0].max_concurrents", 7, "unknown field"),
        (
            "input_per_million_usd: 0.30",
            "input_per_million_usd: -1",
            "models[0].price.input_per_million_usd",
            8,
            "must be a number >= 0",
        ),
        ("    provider: gemini\n", "", "models[0].provider", 3, "is required"),
        (
            "limits: { max_cost_usd: 2.5 }",
            "limits: { max_cost_usd: 0 }",
            "processes[0].limits.max_cost_usd",
            12,
            "must be a number > 0",
        ),
        (
            "limits: { max_cost_usd: 2.5 }",
            "limits: { max_spend: 2.5 }",
            "processes[0].limits.max_spend",
            12,
            "unknown field",
        ),
        (
            "max_cost_usd: 0.05 }",
            "max_cost_usd: cheap }",
            "processes[0].nodes[0].limits.max_cost_usd",
            19,
            "US dollars",
        ),
        (
            "        model: gemini-3.6-flash\n",
            "        model: gemini-unpriced\n",
            "processes[0].nodes[0].limits.max_cost_usd",
            19,
            "needs prices",
        ),
    ],
)
async def test_bad_profiles_and_budgets_are_named_by_file_line_and_field(engine, old, new, field, line, why):
    assert old in PROFILED
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, PROFILED.replace(old, new), "models.yaml")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == field, caught.value.details()
    assert info.metadata["line"] == str(line), caught.value.details()
    assert why in caught.value.details()


async def test_two_profiles_with_one_name_are_refused(engine):
    doubled = PROFILED.replace("processes:", "  - { name: gemini-3.6-flash, provider: gemini }\nprocesses:")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, doubled, "models.yaml")
    info = error_info(caught.value)
    assert info.metadata["field"] == "models[1].name"
    assert "duplicate model profile" in caught.value.details()
