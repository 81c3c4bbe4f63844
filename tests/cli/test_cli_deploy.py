"""`abada deploy` and `abada definitions` against a real engine."""

from __future__ import annotations

from pathlib import Path

from abada.engine.v1 import common_pb2, definition_pb2
from abada_engine.cli import views
from cli_support import abada

# Shaped like examples/support-triage.yaml, minus the agent node and its tool server (deploy would dial it).
TRIAGE = """\
processes:
  - id: support_triage
    start: notify_customer
    nodes:
      - { id: notify_customer, type: service, topic: notify, next: review }
      - { id: review, type: user_task, next: done }
      - { id: done, type: end }
"""


def write(tmp_path: Path, name: str, content: str) -> Path:
    path = tmp_path / name
    path.write_text(content)
    return path


def line_of(content: str, fragment: str) -> int:
    return next(number for number, line in enumerate(content.splitlines(), 1) if fragment in line)


async def test_deploy_shows_version_one_then_unchanged(engine, tmp_path):
    bundle = write(tmp_path, "support-triage.yaml", TRIAGE)
    first = await abada(engine.address, "deploy", str(bundle))
    assert first.exit_code == 0, first.stderr
    assert "deployed support-triage.yaml" in first.stdout
    row = next(line for line in first.stdout.splitlines() if line.startswith("support_triage"))
    assert row.split()[:3] == ["support_triage", "1", "new"]

    again = await abada(engine.address, "deploy", str(bundle))
    assert again.exit_code == 0, again.stderr
    row = next(line for line in again.stdout.splitlines() if line.startswith("support_triage"))
    assert row.split()[:3] == ["support_triage", "1", "unchanged"]


async def test_deploy_json_is_the_deploy_response(engine, tmp_path):
    bundle = write(tmp_path, "support-triage.yaml", TRIAGE)
    ran = await abada(engine.address, "deploy", "--json", str(bundle))
    assert ran.exit_code == 0, ran.stderr
    answer = ran.json()
    assert answer["createdProcessIds"] == ["support_triage"]
    assert answer["definitions"][0]["processId"] == "support_triage"
    assert answer["definitions"][0]["version"] == 1
    assert answer["definitions"][0]["sourceName"] == "support-triage.yaml"


async def test_broken_bundle_names_file_line_and_field_and_exits_2(engine, tmp_path):
    broken = TRIAGE.replace("next: review }", "next: notfy }")
    bundle = write(tmp_path, "support-triage.yaml", broken)
    ran = await abada(engine.address, "deploy", str(bundle))
    assert ran.exit_code == 2
    line = line_of(broken, "notfy")
    # The typo also strands the nodes after it; the engine says so, and the CLI passes every word on.
    assert ran.stderr.splitlines()[0] == (
        f"error: DEFINITION_INVALID: support-triage.yaml:{line}: processes[0].nodes[0].next: unknown node 'notfy'"
        " (and 2 more)"
    )
    assert "Traceback" not in ran.stderr
    listed = await engine.definitions.ListDefinitions(definition_pb2.ListDefinitionsRequest())
    assert list(listed.definitions) == []


async def test_every_violation_of_a_broken_bundle_is_listed(engine, tmp_path):
    broken = TRIAGE.replace("topic: notify", "topik: notify").replace("type: user_task", "type: user_tsk")
    bundle = write(tmp_path, "triage.yaml", broken)
    ran = await abada(engine.address, "deploy", str(bundle))
    assert ran.exit_code == 2
    first, *violations = ran.stderr.splitlines()
    topik, user_tsk = line_of(broken, "topik"), line_of(broken, "user_tsk")
    assert first.startswith(f"error: DEFINITION_INVALID: triage.yaml:{topik}: processes[0].nodes[0].topik: ")
    assert first.endswith("(and 3 more)")
    assert len(violations) == 4
    assert all(v.startswith("  triage.yaml:") for v in violations)
    assert f"  triage.yaml:{topik}: processes[0].nodes[0].topic: is required" in violations
    assert any(
        v.startswith(f"  triage.yaml:{user_tsk}: processes[0].nodes[1].type: 'user_tsk'") for v in violations
    )


async def test_missing_file_is_a_usage_error(engine):
    # A short relative path: the usage panel wraps a long one wherever the width falls.
    ran = await abada(engine.address, "deploy", "no-such-dir/nowhere.yaml")
    assert ran.exit_code == 2
    assert "nowhere.yaml" in ran.stderr


async def test_definitions_lists_versions_and_filters_by_process(engine, tmp_path):
    await abada(engine.address, "deploy", str(write(tmp_path, "a.yaml", TRIAGE)))
    await abada(
        engine.address,
        "deploy",
        str(write(tmp_path, "b.yaml", TRIAGE.replace("topic: notify", "topic: mail"))),
    )
    other = TRIAGE.replace("support_triage", "other")
    await abada(engine.address, "deploy", str(write(tmp_path, "c.yaml", other)))

    ran = await abada(engine.address, "definitions", "--process", "support_triage")
    assert ran.exit_code == 0, ran.stderr
    rows = [line.split() for line in ran.stdout.splitlines()[1:]]
    assert [(row[0], row[1], row[3]) for row in rows] == [
        ("support_triage", "2", "b.yaml"),
        ("support_triage", "1", "a.yaml"),
    ]

    everything = (await abada(engine.address, "definitions", "--json")).json()
    assert sorted((d["processId"], d["version"]) for d in everything["definitions"]) == [
        ("other", 1),
        ("support_triage", 1),
        ("support_triage", 2),
    ]


def test_deployment_view_lists_each_frozen_tool_binding():
    response = definition_pb2.DeployResponse(
        definitions=[
            definition_pb2.Definition(
                id="d-1",
                process_id="support_triage",
                version=3,
                tool_bindings=[
                    common_pb2.ToolBinding(
                        server="crm",
                        tool="get_customer",
                        policy=common_pb2.TOOL_POLICY_READ,
                        url="https://crm-mcp.acme.internal/mcp",
                        transport="streamable-http",
                        credential="crm-token",
                        input_schema_sha256="ab" * 32,
                    ),
                    common_pb2.ToolBinding(
                        server="crm",
                        tool="create_ticket",
                        policy=common_pb2.TOOL_POLICY_WRITE,
                        idempotency=common_pb2.IDEMPOTENCY_KEY,
                        url="https://crm-mcp.acme.internal/mcp",
                        credential="crm-token",
                    ),
                ],
            )
        ],
        created_process_ids=[],
    )
    text = views.deployment("support-triage.yaml", response)
    assert "support_triage v3 frozen tool bindings:" in text
    read = next(line for line in text.splitlines() if line.startswith("crm/get_customer"))
    write_ = next(line for line in text.splitlines() if line.startswith("crm/create_ticket"))
    assert read.split()[:2] == ["crm/get_customer", "read"]
    assert "crm-token" in read and "https://crm-mcp.acme.internal/mcp" in read and "abababababa…" in read
    assert write_.split()[:3] == ["crm/create_ticket", "write", "key"]
    assert next(line for line in text.splitlines() if line.startswith("support_triage")).split()[:3] == [
        "support_triage",
        "3",
        "unchanged",
    ]
