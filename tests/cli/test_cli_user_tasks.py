"""`abada user-tasks` and `abada complete-user-task` on a process that waits for a person."""

from __future__ import annotations

from abada.engine.v1 import process_pb2
from abada_engine.cli.render import plain_numbers
from cli_support import abada
from engine_helpers import deploy, start
from google.protobuf import json_format

REVIEW = """
processes:
  - id: review
    start: approve
    nodes:
      - { id: approve, type: user_task, next: done }
      - { id: done, type: end }
"""


async def test_user_tasks_lists_the_waiting_task(engine):
    await deploy(engine, REVIEW)
    instance = await start(engine, "review", customerId="C-42")
    ran = await abada(engine.address, "user-tasks")
    assert ran.exit_code == 0, ran.stderr
    header, row = ran.stdout.splitlines()
    assert header.split() == ["ID", "INSTANCE", "PROCESS", "NODE", "WAITING", "VARIABLES"]
    assert row.split()[1:4] == [instance.id, "review", "approve"]

    listed = (await abada(engine.address, "user-tasks", "--instance", instance.id, "--json")).json()
    assert [(t["instanceId"], t["nodeId"]) for t in listed["userTasks"]] == [(instance.id, "approve")]


async def test_complete_user_task_writes_typed_variables_and_moves_on(engine):
    await deploy(engine, REVIEW)
    instance = await start(engine, "review")
    tasks = await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=instance.id))
    task_id = tasks.user_tasks[0].id

    ran = await abada(
        engine.address, "complete-user-task", task_id, "--var", "approved=true", "--var", "note=refund sent"
    )
    assert ran.exit_code == 0, ran.stderr
    assert f"completed user task {task_id}" in ran.stdout
    assert "COMPLETED" in ran.stdout

    got = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance.id))
    assert got.instance.state == process_pb2.INSTANCE_STATE_COMPLETED
    assert plain_numbers(json_format.MessageToDict(got.instance.variables)) == {
        "approved": True,
        "note": "refund sent",
    }
    assert (await abada(engine.address, "user-tasks")).stdout.strip() == "no user tasks"


async def test_completing_a_finished_user_task_fails_clearly(engine):
    await deploy(engine, REVIEW)
    instance = await start(engine, "review")
    tasks = await engine.processes.ListUserTasks(process_pb2.ListUserTasksRequest(instance_id=instance.id))
    task_id = tasks.user_tasks[0].id
    assert (await abada(engine.address, "complete-user-task", task_id, "--json")).exit_code == 0
    again = await abada(engine.address, "complete-user-task", task_id)
    assert again.exit_code == 1
    assert again.stderr.startswith("error: ")
    assert "Traceback" not in again.stderr
