"""What `abada show` and `abada instances --parent` say of call activities."""

from __future__ import annotations

from abada.engine.v1 import external_task_pb2
from cli_support import abada
from engine_helpers import deploy, fetch, start

BUNDLE = """
processes:
  - id: credit_check
    start: score
    nodes:
      - { id: score, type: service, topic: cli-score, retries: 0, next: done }
      - { id: done, type: end }
  - id: loan
    start: check
    nodes:
      - { id: check, type: call, process: credit_check, result_variable: credit, next: done }
      - { id: done, type: end }
"""


async def test_show_lists_the_child_with_its_state_and_incidents(engine):
    await deploy(engine, BUNDLE)
    parent = await start(engine, "loan", applicant="Ada")
    [score] = await fetch(engine, "w", "cli-score")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=score.id, worker_id="w", lease_token=score.lease_token, error_message="down"
        )
    )

    shown = await abada(engine.address, "show", parent.id)
    assert shown.exit_code == 0, shown.stderr
    assert "called instances" in shown.stdout
    [row] = [line for line in shown.stdout.splitlines() if line.startswith(score.instance_id)]
    assert "check" in row and "credit_check v1" in row and "ACTIVE" in row and row.rstrip().endswith("1")

    child = await abada(engine.address, "show", score.instance_id)
    assert "called by" in child.stdout and parent.id in child.stdout

    listed = await abada(engine.address, "-o", "json", "instances", "--parent", parent.id)
    assert [i["id"] for i in listed.json()["instances"]] == [score.instance_id]
    as_json = await abada(engine.address, "-o", "json", "show", parent.id)
    [child_json] = as_json.json()["instance"]["children"]
    assert child_json["instanceId"] == score.instance_id and child_json["openIncidents"] == 1
