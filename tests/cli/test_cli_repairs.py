"""`abada modify` and `abada migrate`: repairing a running instance and moving instances to a new version."""

from __future__ import annotations

import json

from abada.engine.v1 import process_pb2
from cli_support import abada
from engine_helpers import deploy, plain, start

V1 = """
processes:
  - id: cli_repairs
    start: {node}
    nodes:
      - {{ id: {node}, type: service, topic: cli-repairs, next: done }}
      - {{ id: done, type: end }}
"""


async def test_modify_sets_and_unsets_variables_with_a_reason(engine):
    await deploy(engine, V1.format(node="work"))
    started = await start(engine, "cli_repairs", customerId="C-1", draft="x")
    ran = await abada(
        engine.address,
        "modify",
        started.id,
        "--set",
        "customerId=C-2",
        "--set",
        "priority=3",
        "--unset",
        "draft",
        "--reason",
        "typo",
        "-o",
        "json",
    )
    assert ran.exit_code == 0, ran.stderr
    assert json.loads(ran.stdout)["instance"]["variables"] == {"customerId": "C-2", "priority": 3}
    history = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=started.id))
    assert [plain(e.data)["reason"] for e in history.events if e.type.startswith("VARIABLE_")] == ["typo"] * 3

    bad = await abada(engine.address, "modify", started.id, "--move", "work", "--reason", "r")
    assert bad.exit_code == 2 and "FROM_NODE=TO_NODE" in bad.stderr


async def test_migrate_dry_run_prints_the_plan_and_yes_moves_the_instances(engine):
    await deploy(engine, V1.format(node="work"))
    started = await start(engine, "cli_repairs")
    await deploy(engine, V1.format(node="job"))

    refused = await abada(engine.address, "migrate", "--from", "cli_repairs:1", "--to", "2", "--dry-run")
    assert refused.exit_code != 0 and "'work'" in refused.stderr
    dry = await abada(
        engine.address, "migrate", "--from", "cli_repairs:1", "--to", "2", "--map", "work=job", "--dry-run"
    )
    assert dry.exit_code == 0, dry.stderr
    assert "1 instance(s) of cli_repairs:1 would move to version 2" in dry.stdout
    assert "work -> job" in dry.stdout
    unasked = await abada(
        engine.address, "migrate", "--from", "cli_repairs:1", "--to", "2", "--map", "work=job"
    )
    assert unasked.exit_code == 2 and "add --yes" in unasked.stderr
    listed = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=started.id))
    assert listed.instance.version == 1

    moved = await abada(
        engine.address, "migrate", "--from", "cli_repairs:1", "--to", "2", "--map", "work=job", "--yes"
    )
    assert moved.exit_code == 0, moved.stderr
    assert "migrated 1 instance(s)" in moved.stdout
    listed = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=started.id))
    assert (listed.instance.version, list(listed.instance.active_node_ids)) == (2, ["job"])
