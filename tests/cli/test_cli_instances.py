"""`abada start`, `abada instances` and `abada show` against a real engine."""

from __future__ import annotations

import json

from abada.engine.v1 import process_pb2
from abada_engine.cli.render import plain_numbers
from cli_support import abada
from engine_helpers import deploy, start

NOTIFY = """
processes:
  - id: notify
    start: send
    nodes:
      - { id: send, type: service, topic: notify, next: done }
      - { id: done, type: end }
  - id: instant
    start: done
    nodes:
      - { id: done, type: end }
"""


async def variables_of(engine, instance_id: str) -> dict:
    from google.protobuf import json_format

    got = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
    return plain_numbers(json_format.MessageToDict(got.instance.variables))


def card(stdout: str) -> dict[str, str]:
    pairs = {}
    for line in stdout.splitlines():
        key, _, value = line.partition("  ")
        if value:
            pairs[key.strip()] = value.strip()
    return pairs


async def test_start_types_var_values_as_json_when_they_parse(engine):
    await deploy(engine, NOTIFY)
    ran = await abada(
        engine.address,
        "start",
        "notify",
        "--var", "count=3",
        "--var", "ratio=0.5",
        "--var", "vip=true",
        "--var", 'order={"id": 5531, "items": ["parcel"]}',
        "--var", "customerId=C-42",
        "--var", "zip=007",
        "--var", "message=My parcel never arrived",
        "--var", "nothing=null",
        "--var", "weird=NaN",
        "--var", "empty=",
        "--business-key", "ticket-17",
    )  # fmt: skip
    assert ran.exit_code == 0, ran.stderr
    shown = card(ran.stdout)
    assert shown["token at"] == "send"
    assert shown["state"] == "ACTIVE"
    assert shown["process"] == "notify v1"
    assert shown["business key"] == "ticket-17"
    assert await variables_of(engine, shown["instance"]) == {
        "count": 3,
        "ratio": 0.5,
        "vip": True,
        "order": {"id": 5531, "items": ["parcel"]},
        "customerId": "C-42",
        "zip": "007",
        "message": "My parcel never arrived",
        "nothing": None,
        "weird": "NaN",
        "empty": "",
    }


async def test_var_overrides_vars_json_and_version_is_pinned(engine):
    await deploy(engine, NOTIFY)
    await deploy(engine, NOTIFY.replace("topic: notify", "topic: mail"))
    ran = await abada(
        engine.address,
        "start",
        "notify",
        "--vars-json", '{"customerId": "C-1", "priority": "low"}',
        "--var", "priority=high",
        "--version", "1",
        "--json",
    )  # fmt: skip
    assert ran.exit_code == 0, ran.stderr
    started = ran.json()["instance"]
    assert started["version"] == 1
    assert started["currentNodeId"] == "send"
    assert started["state"] == "active"
    assert started["variables"] == {"customerId": "C-1", "priority": "high"}


async def test_bad_variables_are_refused_before_calling_the_engine(engine):
    await deploy(engine, NOTIFY)
    no_equals = await abada(engine.address, "start", "notify", "--var", "customerId")
    assert no_equals.exit_code == 2
    assert no_equals.stderr.strip() == "error: --var 'customerId': expected KEY=VALUE"
    not_object = await abada(engine.address, "start", "notify", "--vars-json", "[1, 2]")
    assert not_object.exit_code == 2
    assert "--vars-json: must be a JSON object" in not_object.stderr
    # Starting with { or [ means JSON was meant: a slip is refused, not sent as a string.
    for broken in ('order={"id": 5531,}', "items=[1, 2"):
        slipped = await abada(engine.address, "start", "notify", "--var", broken)
        assert slipped.exit_code == 2
        key = broken.split("=")[0]
        assert slipped.stderr.startswith(f"error: --var {key}: starts like a JSON "), slipped.stderr
        assert "is not valid JSON" in slipped.stderr
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest())
    assert list(listed.instances) == []


async def test_unknown_process_is_not_found_and_exits_1(engine):
    ran = await abada(engine.address, "start", "missing")
    assert ran.exit_code == 1
    message = ran.stderr.strip()
    assert message.startswith("error: NOT_FOUND: ") and "'missing'" in message
    assert message.endswith("(field process_id)")


async def test_instances_lists_and_filters_by_state_and_process(engine):
    await deploy(engine, NOTIFY)
    waiting = await start(engine, "notify", customerId="C-42")
    finished = await start(engine, "instant")

    ran = await abada(engine.address, "instances")
    assert ran.exit_code == 0, ran.stderr
    header, *rows = ran.stdout.splitlines()
    assert header.split()[:5] == ["ID", "PROCESS", "VERSION", "STATE", "NODE"]
    by_id = {row.split()[0]: row.split() for row in rows}
    assert by_id[waiting.id][1:5] == ["notify", "1", "ACTIVE", "send"]
    assert by_id[finished.id][1:5] == ["instant", "1", "COMPLETED", "done"]

    active = await abada(engine.address, "instances", "--state", "active", "--json")
    assert [i["id"] for i in active.json()["instances"]] == [waiting.id]
    of_instant = await abada(engine.address, "instances", "--process", "instant", "--json")
    assert [i["id"] for i in of_instant.json()["instances"]] == [finished.id]
    none = await abada(engine.address, "instances", "--state", "canceled")
    assert none.stdout.strip() == "no instances"


async def test_instances_limit_stops_early_and_says_there_is_more(engine):
    await deploy(engine, NOTIFY)
    for _ in range(3):
        await start(engine, "instant")
    ran = await abada(engine.address, "instances", "--limit", "2")
    assert ran.exit_code == 0, ran.stderr
    assert len(ran.stdout.splitlines()) == 1 + 2
    assert "raise --limit" in ran.stderr
    everything = await abada(engine.address, "instances", "--json")
    assert len(everything.json()["instances"]) == 3


async def test_show_prints_state_variables_and_history(engine):
    await deploy(engine, NOTIFY)
    instance = await start(engine, "notify", customerId="C-42", order={"id": 5531})
    ran = await abada(engine.address, "show", instance.id)
    assert ran.exit_code == 0, ran.stderr
    shown = card(ran.stdout.split("variables:")[0])
    assert shown["instance"] == instance.id
    assert shown["state"] == "ACTIVE"
    assert shown["current node"] == "send"
    assert '"customerId": "C-42"' in ran.stdout
    assert '"id": 5531' in ran.stdout
    history = ran.stdout.split("history:\n", 1)[1].splitlines()
    assert history[0].split() == ["TIME", "TYPE", "NODE", "TASK", "DATA"]
    rows = [line.split() for line in history[1:]]
    assert rows[0][2] == "INSTANCE_STARTED"
    [created] = [row for row in rows if row[2] == "TASK_CREATED"]
    task_id = created[4]
    assert created[3] == "send" and len(task_id) == 36
    # The task id `abada journal` needs, listed by node above the history.
    tasks = ran.stdout.split("tasks (abada journal TASK):\n", 1)[1].split("\n\n")[0].splitlines()
    assert tasks[0].split() == ["NODE", "TASK"] and tasks[1].split() == ["send", task_id]


async def test_show_json_holds_instance_and_history(engine):
    await deploy(engine, NOTIFY)
    instance = await start(engine, "instant")
    shown = (await abada(engine.address, "show", instance.id, "--json")).json()
    assert shown["instance"]["id"] == instance.id
    assert shown["instance"]["state"] == "completed"
    assert shown["events"][0]["type"] == "INSTANCE_STARTED"
    assert shown["events"][-1]["type"] == "INSTANCE_COMPLETED"


async def test_show_of_a_malformed_id_is_invalid_input(engine):
    ran = await abada(engine.address, "show", "not-a-uuid")
    assert ran.exit_code == 2
    assert ran.stderr.startswith("error: ")
    assert "instance_id" in ran.stderr


async def test_instances_all_ignores_the_limit_and_business_key_filters(engine):
    await deploy(engine, NOTIFY)
    for n in range(3):
        await engine.processes.StartInstance(
            process_pb2.StartInstanceRequest(process_id="instant", business_key=f"order-{n}")
        )
    everything = await abada(engine.address, "instances", "--all", "--limit", "1", "--json")
    assert everything.exit_code == 0, everything.stderr
    assert len(everything.json()["instances"]) == 3
    keyed = await abada(engine.address, "instances", "--business-key", "order-1", "--json")
    assert [i["businessKey"] for i in keyed.json()["instances"]] == ["order-1"]


async def test_start_with_a_request_id_sent_twice_starts_one_instance(engine):
    await deploy(engine, NOTIFY)
    first = await abada(engine.address, "start", "notify", "--request-id", "hook-1", "-o", "json")
    assert first.exit_code == 0, first.stderr
    again = await abada(engine.address, "start", "notify", "--request-id", "hook-1")
    assert again.exit_code == 0, again.stderr
    assert again.stdout.startswith("already started (same --request-id)")
    assert card(again.stdout)["instance"] == json.loads(first.stdout)["instance"]["id"]
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(process_id="notify"))
    assert len(listed.instances) == 1


async def test_instances_since_and_until_a_time(engine):
    await deploy(engine, NOTIFY)
    early = (await start(engine, "notify")).id
    listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest(process_id="notify"))
    started_at = listed.instances[0].create_time.ToDatetime().isoformat() + "Z"
    late = (await start(engine, "notify")).id
    since = await abada(
        engine.address, "instances", "--process", "notify", "--until", started_at, "-o", "json"
    )
    assert since.exit_code == 0, since.stderr
    assert [i["id"] for i in json.loads(since.stdout)["instances"]] == []
    after = await abada(
        engine.address, "instances", "--process", "notify", "--since", started_at, "-o", "json"
    )
    assert [i["id"] for i in json.loads(after.stdout)["instances"]] == [late, early]
    zoneless = await abada(engine.address, "instances", "--since", "2026-12-04T09:00:00")
    assert zoneless.exit_code != 0
    assert "--since '2026-12-04T09:00:00': give the zone too" in zoneless.stderr


async def test_instances_where_a_variable_has_a_value(engine):
    await deploy(engine, NOTIFY)
    alice = (await start(engine, "notify", customerId="C-42", vip=True)).id
    await start(engine, "notify", customerId="C-43", vip=True)
    found = await abada(
        engine.address, "instances", "--var", "customerId=C-42", "--where", "vip=true", "-o", "json"
    )
    assert found.exit_code == 0, found.stderr
    assert [i["id"] for i in json.loads(found.stdout)["instances"]] == [alice]
    malformed = await abada(engine.address, "instances", "--var", "customerId")
    assert malformed.exit_code != 0
    assert "--var 'customerId': expected KEY=VALUE" in malformed.stderr
