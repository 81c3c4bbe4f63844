"""Which provider serves an agent node: decided at deploy, refused with file:line:field when nothing
decides it, frozen with the version and handed to the worker in the agent work."""

from __future__ import annotations

import grpc
import pytest
from engine_helpers import deploy, error_info, fetch, start


def bundle(model_lines: str, models: str = "") -> str:
    return f"""{models}
processes:
  - id: ask
    start: agent
    nodes:
      - id: agent
        type: agent
{model_lines}
        prompt: Say hello
        result_variable: answer
        next: done
      - {{ id: done, type: end }}
"""


@pytest.mark.parametrize(
    ("model_lines", "provider"),
    [
        ("        model: gemini-3.6-flash", "gemini"),
        ("        model: gpt-5-mini", "openai"),
        ("        model: o4-mini", "openai"),
        ("        model: claude-sonnet-4-5", "anthropic"),
        # A self-hosted model behind an OpenAI-compatible server: the node says which API.
        ("        model: llama-3.1-8b-instruct\n        provider: openai", "openai"),
        # The node's field wins over the model name's family (an Anthropic model through a gateway).
        ("        model: claude-sonnet-4-5\n        provider: openai", "openai"),
    ],
)
async def test_the_provider_is_frozen_with_the_version_and_handed_to_the_worker(
    engine, model_lines, provider
):
    await deploy(engine, bundle(model_lines), "ask.yaml")
    await start(engine, "ask")

    [task] = await fetch(engine, "w", "abada:agent")

    assert task.agent_work.provider == provider


@pytest.mark.parametrize(
    ("model_lines", "field", "line", "why"),
    [
        (
            "        model: llama-3.1-8b-instruct",
            "processes[0].nodes[0].model",
            8,
            "cannot tell which provider",
        ),
        (
            "        model: gpt-5-mini\n        provider: azure",
            "processes[0].nodes[0].provider",
            9,
            "not a provider",
        ),
        (
            "        model: gpt-5-mini\n        provider: ''",
            "processes[0].nodes[0].provider",
            9,
            "non-empty string",
        ),
    ],
)
async def test_a_node_no_provider_can_serve_is_refused_at_deploy(engine, model_lines, field, line, why):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle(model_lines), "ask.yaml")

    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert (info.reason, info.metadata["field"], info.metadata["line"]) == (
        "DEFINITION_INVALID",
        field,
        str(line),
    )
    assert caught.value.details().startswith(f"ask.yaml:{line}: {field}: ")
    assert why in caught.value.details()


async def test_changing_only_the_provider_makes_a_new_version(engine):
    first = await deploy(engine, bundle("        model: claude-sonnet-4-5"), "ask.yaml")
    second = await deploy(
        engine, bundle("        model: claude-sonnet-4-5\n        provider: openai"), "ask.yaml"
    )

    assert [d.version for d in first.definitions] == [1]
    assert [d.version for d in second.definitions] == [2]


PROFILES = """
models:
  - { name: my-llama, provider: openai }
  - { name: claude-sonnet-4-5, provider: anthropic }
"""


async def test_a_model_profile_decides_the_provider_of_the_nodes_that_name_it(engine):
    await deploy(engine, bundle("        model: my-llama", PROFILES), "ask.yaml")
    await start(engine, "ask")

    [task] = await fetch(engine, "w", "abada:agent")

    assert (task.agent_work.model, task.agent_work.provider) == ("my-llama", "openai")


async def test_a_node_provider_contradicting_its_model_profile_is_refused(engine):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(
            engine, bundle("        model: claude-sonnet-4-5\n        provider: openai", PROFILES), "ask.yaml"
        )

    info = error_info(caught.value)
    assert info.metadata["field"] == "processes[0].nodes[0].provider"
    assert "contradicts the model profile" in caught.value.details()
