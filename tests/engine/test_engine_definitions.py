"""Deploying bundles: versions, identical redeploys, and bad bundles refused whole."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import definition_pb2, external_task_pb2, process_pb2
from abada_engine.definitions.catalog import DefinitionCatalog
from engine_helpers import GREET, bad_request, deploy, error_info, start

TWO_PROCESSES = """
processes:
  - id: first
    start: a
    nodes:
      - { id: a, type: service, topic: t1, next: end }
      - { id: end, type: end }
  - id: second
    start: b
    nodes:
      - { id: b, type: user_task, next: end }
      - { id: end, type: end }
"""


async def test_deploy_creates_version_one_and_identical_redeploy_returns_it(engine):
    first = await deploy(engine, GREET, "greet.yaml")
    assert [(d.process_id, d.version) for d in first.definitions] == [("greet", 1)]
    assert list(first.created_process_ids) == ["greet"]
    again = await deploy(engine, GREET + "\n# only a comment changed\n", "greet.yaml")
    assert again.definitions[0].id == first.definitions[0].id
    assert list(again.created_process_ids) == []
    listed = await engine.definitions.ListDefinitions(
        definition_pb2.ListDefinitionsRequest(process_id="greet")
    )
    assert [d.version for d in listed.definitions] == [1]


async def test_changed_process_gets_a_new_version_and_instances_stay_on_theirs(engine):
    await deploy(engine, GREET)
    old = await start(engine, "greet")
    changed = GREET.replace("topic: greetings", "topic: salutations")
    second = await deploy(engine, changed)
    assert second.definitions[0].version == 2
    new = await start(engine, "greet")
    assert (old.version, new.version) == (1, 2)
    got = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=old.id))
    assert got.instance.version == 1
    pinned = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id="greet", version=1)
    )
    assert pinned.instance.version == 1
    latest = await engine.definitions.GetDefinition(definition_pb2.GetDefinitionRequest(process_id="greet"))
    assert latest.definition.version == 2
    assert latest.definition.spec["nodes"][0]["topic"] == "salutations"


async def test_a_start_takes_the_version_another_replica_just_deployed(engine, db):
    """The serving replica remembers v1 as the latest; a deploy through another replica is seen by the
    very next start there, with no wait and no stale version."""
    await deploy(engine, GREET)
    first = await start(engine, "greet")
    other_replica = DefinitionCatalog(db)
    await other_replica.deploy(GREET.replace("topic: greetings", "topic: salutations"), "greet.yaml")
    second = await start(engine, "greet")
    assert (first.version, second.version) == (1, 2)
    tasks = await engine.tasks.FetchAndLock(
        external_task_pb2.FetchAndLockRequest(
            worker_id="w",
            max_tasks=2,
            topics=[external_task_pb2.TopicSubscription(name="salutations", lease_ms=60_000)],
        )
    )
    assert [t.instance_id for t in tasks.tasks] == [second.id]


async def test_bundle_with_two_processes_deploys_both(engine):
    response = await deploy(engine, TWO_PROCESSES)
    assert sorted(d.process_id for d in response.definitions) == ["first", "second"]


@pytest.mark.parametrize(
    ("bundle", "field", "line", "why"),
    [
        (
            GREET.replace("next: done }", "next: nowhere }"),
            "processes[0].nodes[0].next",
            6,
            "unknown node 'nowhere'",
        ),
        (
            GREET.replace(
                "- { id: done, type: end }", "- { id: done, type: end }\n      - { id: lost, type: end }"
            ),
            "processes[0].nodes[2].id",
            8,
            "unreachable",
        ),
        (
            GREET.replace(
                "- { id: done, type: end }", "- { id: done, type: end }\n      - { id: hello, type: end }"
            ),
            "processes[0].nodes[2].id",
            8,
            "duplicate node id 'hello'",
        ),
        (GREET.replace("type: service", "type: robot"), "processes[0].nodes[0].type", 6, "is not one of"),
        (
            GREET.replace("topic: greetings", "topik: greetings"),
            "processes[0].nodes[0].topik",
            6,
            "unknown field",
        ),
        (GREET.replace("start: hello", "start: nope"), "processes[0].start", 4, "unknown node 'nope'"),
        ("processes: [", "(bundle)", 1, "not valid YAML"),
    ],
)
async def test_bad_bundle_is_refused_with_file_line_and_field(engine, bundle, field, line, why):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle, "greet.yaml")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(caught.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == field
    assert info.metadata["file"] == "greet.yaml"
    assert info.metadata["line"] == str(line)
    assert why in caught.value.details()
    assert caught.value.details().startswith(f"greet.yaml:{line}: {field}: ")


AGENT_BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: http://127.0.0.1:1/mcp
    credential: crm-token
    tools:
      get_customer: { policy: read }
processes:
  - id: triage
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: Look up ${customerId}
        tools: [crm/get_customer]
        result_variable: triage
        output_schema: { type: object, required: [priority] }
        next: route
      - id: route
        type: exclusive
        branches:
          - { when: 'triage.priority == "high"', next: done }
        default: done
      - { id: done, type: end }
"""


@pytest.mark.parametrize(
    ("old", "new", "field", "why"),
    [
        ("        result_variable: triage\n", "", "processes[0].nodes[0].result_variable", "is required"),
        ("required: [priority]", "required: 7", "processes[0].nodes[0].output_schema", "JSON Schema"),
        (
            "'triage.priority == \"high\"'",
            "'triage.priority =='",
            "processes[0].nodes[1].branches[0].when",
            "CEL",
        ),
        ("[crm/get_customer]", "[crm/delete_everything]", "processes[0].nodes[0].tools[0]", "not declared"),
        ("[crm/get_customer]", "[erp/get_customer]", "processes[0].nodes[0].tools[0]", "unknown tool server"),
        (
            "{ policy: read }",
            "{ policy: maybe }",
            "tool_servers[0].tools.get_customer.policy",
            "read or write",
        ),
        ("transport: streamable-http", "transport: stdio", "tool_servers[0].transport", "not supported"),
        ("Look up ${customerId}", "Look up ${customer id}", "processes[0].nodes[0].prompt", "bad reference"),
    ],
)
async def test_agent_bundle_problems_are_named(engine, old, new, field, why):
    assert old in AGENT_BUNDLE
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, AGENT_BUNDLE.replace(old, new), "triage.yaml")
    info = error_info(caught.value)
    assert info.reason == "DEFINITION_INVALID"
    assert info.metadata["field"] == field, caught.value.details()
    assert why in caught.value.details()


async def test_every_problem_is_listed_and_nothing_is_stored(engine):
    broken = TWO_PROCESSES.replace(
        "next: end }\n      - { id: end, type: end }\n  - id: second",
        "next: ende }\n      - { id: end, type: end }\n  - id: second",
    ).replace("type: user_task", "type: user_tsk")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, broken, "two.yaml")
    violations = bad_request(caught.value)
    assert any("unknown node 'ende'" in v for v in violations)
    assert any("user_tsk" in v for v in violations)
    assert all(v.startswith("two.yaml:") for v in violations)
    listed = await engine.definitions.ListDefinitions(definition_pb2.ListDefinitionsRequest())
    assert list(listed.definitions) == []


async def test_unknown_process_is_not_found_with_the_field(engine):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await start(engine, "missing")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert error_info(caught.value).metadata["field"] == "process_id"
