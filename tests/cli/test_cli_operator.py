"""The operator's commands: cancel, start --wait, show --follow, tasks, topics; output formats,
global options anywhere, versions, completion, width-aware tables and errors in CLI terms."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import yaml
from abada.engine.v1 import external_task_pb2
from cli_support import abada, fetch_one
from engine_helpers import deploy, fetch, start, struct

BUNDLE = """
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
  - id: fragile
    start: send
    nodes:
      - { id: send, type: service, topic: fragile, retries: 0, next: done }
      - { id: done, type: end }
"""


async def fetch_when_there(engine, topic: str) -> external_task_pb2.ExternalTask:
    """The task of an instance the CLI is starting right now: long-poll until it is there."""
    [task] = await fetch(engine, "cli-test-worker", topic, wait_ms=15_000)
    return task


async def complete(engine, topic: str, variables: dict) -> external_task_pb2.ExternalTask:
    task = await fetch_when_there(engine, topic)
    await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="cli-test-worker",
            lease_token=task.lease_token,
            variables=struct(variables),
        )
    )
    return task


async def test_cancel_ends_the_instance_and_withdraws_its_task(engine):
    await deploy(engine, BUNDLE)
    instance = await start(engine, "notify")
    ran = await abada(engine.address, "cancel", instance.id, "--reason", "customer withdrew")
    assert ran.exit_code == 0, ran.stderr
    assert ran.stdout.splitlines()[0] == "canceled"
    assert "CANCELED" in ran.stdout
    shown = (await abada(engine.address, "show", instance.id, "-o", "json")).json()
    assert shown["instance"]["state"] == "canceled"
    assert (await abada(engine.address, "tasks", "--topic", "notify")).stdout.strip() == "no open tasks"
    again = await abada(engine.address, "cancel", instance.id)
    assert again.exit_code == 1 and again.stderr.startswith("error: ")


async def test_start_wait_prints_the_outcome_once_a_worker_finishes(engine):
    await deploy(engine, BUNDLE)
    waiting = asyncio.create_task(
        abada(engine.address, "start", "notify", "--var", "customerId=C-42", "--wait", "--timeout", "20")
    )
    await complete(engine, "notify", {"notified": True})
    ran = await waiting
    assert ran.exit_code == 0, ran.stderr
    assert "state     COMPLETED" in ran.stdout and "token at  done" in ran.stdout
    assert '"notified": true' in ran.stdout
    assert "waiting for it to end" in ran.stderr


async def test_start_wait_stops_at_an_incident_and_on_timeout(engine):
    await deploy(engine, BUNDLE)
    waiting = asyncio.create_task(abada(engine.address, "start", "fragile", "--wait", "-o", "json"))
    task = await fetch_when_there(engine, "fragile")
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=task.id,
            worker_id="cli-test-worker",
            lease_token=task.lease_token,
            error_message="relay down",
        )
    )
    held = await waiting
    assert held.exit_code == 1
    outcome = held.json()
    assert outcome["instance"]["openIncidents"] == 1
    assert [i["type"] for i in outcome["incidents"]] == ["FAILED_TASK"]
    assert outcome["incidents"][0]["taskId"] == task.id

    slow = await abada(engine.address, "start", "notify", "--wait", "--timeout", "0.5")
    assert slow.exit_code == 3
    assert "state     ACTIVE" in slow.stdout
    assert "gave up waiting after 0.5s" in slow.stderr


async def test_show_follow_streams_history_until_the_instance_ends(engine):
    await deploy(engine, BUNDLE)
    instance = await start(engine, "notify")
    following = asyncio.create_task(abada(engine.address, "show", instance.id, "--follow"))
    await asyncio.sleep(0.7)  # let it print what is there and poll once more; it must still be running
    assert not following.done()
    task = await complete(engine, "notify", {"notified": True})
    ran = await asyncio.wait_for(following, 20)
    assert ran.exit_code == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith(f"instance {instance.id} (notify v1)")
    types = [line.split("  ")[1] for line in lines[1:-1]]
    assert types[0] == "INSTANCE_STARTED"
    assert types.index("TASK_CREATED") < types.index("TASK_COMPLETED") < types.index("INSTANCE_COMPLETED")
    assert any(f"task {task.id}" in line for line in lines)
    assert lines[-1] == f"instance {instance.id} COMPLETED at done"

    as_json = await abada(engine.address, "show", instance.id, "--follow", "--json")
    events = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert events[-1]["type"] == "INSTANCE_COMPLETED"


async def test_tasks_and_topics_show_the_queue(engine):
    await deploy(engine, BUNDLE)
    first = await start(engine, "notify")
    await start(engine, "notify")
    leased = await fetch_one(engine, "notify", worker_id="mailer/1")

    ran = await abada(engine.address, "tasks", "--topic", "notify")
    assert ran.exit_code == 0, ran.stderr
    header, *rows = ran.stdout.splitlines()
    assert header.split()[:6] == ["ID", "TOPIC", "STATE", "ATTEMPT", "RETRIES", "LEFT"]
    by_id = {row.split()[0]: row.split() for row in rows}
    assert by_id[leased.id][2:6] == ["LEASED", "1", "3", "mailer/1"]
    [waiting] = [cells for task_id, cells in by_id.items() if task_id != leased.id]
    assert waiting[2:6] == ["READY", "0", "3", "-"]

    mine = (await abada(engine.address, "tasks", "--instance", first.id, "-o", "json")).json()
    assert [t["instanceId"] for t in mine["tasks"]] == [first.id]

    topics = await abada(engine.address, "topics")
    assert topics.exit_code == 0, topics.stderr
    header, row = topics.stdout.splitlines()
    assert header.split() == ["TOPIC", "READY", "LEASED", "DELAYED", "DEMAND", "OLDEST", "READY", "PARKED"]
    assert row.split()[:5] == ["notify", "1", "1", "0", "2"]

    # JSON and YAML keep the proto's types: counts are numbers, and a zero is there, not left out.
    as_json = (await abada(engine.address, "topics", "-o", "json")).json()
    as_yaml = yaml.safe_load((await abada(engine.address, "topics", "-o", "yaml")).stdout)
    for listed in (as_json, as_yaml):
        [notify] = [t for t in listed["topics"] if t["name"] == "notify"]
        assert {k: notify[k] for k in ("ready", "leased", "delayed", "demand", "quotaWaiting", "parked")} == {
            "ready": 1,
            "leased": 1,
            "delayed": 0,
            "demand": 2,
            "quotaWaiting": 0,
            "parked": 0,
        }
    tasks_json = (await abada(engine.address, "tasks", "--topic", "notify", "-o", "json")).json()
    attempts = {t["id"]: t["attempt"] for t in tasks_json["tasks"]}
    assert attempts[leased.id] == 1
    assert sorted(attempts.values()) == [0, 1]


async def test_output_formats_and_the_environment_default(engine):
    await deploy(engine, BUNDLE)
    instance = await start(engine, "instant")
    as_yaml = await abada(engine.address, "instances", "-o", "yaml")
    assert yaml.safe_load(as_yaml.stdout)["instances"][0]["id"] == instance.id
    from_env = await abada(engine.address, "instances", env={"ABADA_OUTPUT": "json"})
    assert from_env.json()["instances"][0]["id"] == instance.id
    kept = await abada(engine.address, "instances", "--json")
    assert kept.json() == from_env.json()
    # The state is the word `--state` takes, so a listing's answer feeds the next command as is.
    assert from_env.json()["instances"][0]["state"] == "completed"
    wrong = await abada(engine.address, "instances", "-o", "xml")
    assert wrong.exit_code == 2


async def test_global_options_are_accepted_after_the_command(engine, engine_tokens, tmp_path):
    await deploy(engine, BUNDLE)
    token_file = tmp_path / "operator.token"
    token_file.write_text(engine_tokens.operator + "\n")
    ran = await abada(
        "127.0.0.1:1",  # wrong on purpose: the --engine after the command must win
        "instances",
        "--token-file",
        str(token_file),
        "--engine",
        engine.address,
        "--output=json",
        env={"ABADA_TOKEN": ""},
    )
    assert ran.exit_code == 0, ran.stderr
    assert ran.json().get("instances", []) == []


async def test_without_a_token_the_error_names_the_flag_and_variable(engine):
    ran = await abada(engine.address, "instances", env={"ABADA_TOKEN": ""})
    assert ran.exit_code == 1
    assert ran.stderr.strip() == (
        f"error: the engine at {engine.address} wants a token (UNAUTHENTICATED): "
        "give --token-file FILE (or set ABADA_TOKEN_FILE), or --token / ABADA_TOKEN"
    )
    unknown = await abada(engine.address, "instances", env={"ABADA_TOKEN": "nobody-knows-me"})
    assert unknown.stderr.strip() == (
        f"error: the engine at {engine.address} does not know the token from ABADA_TOKEN (UNAUTHENTICATED)"
    )


async def test_a_rejected_token_is_reported_where_it_came_from(engine, tmp_path):
    flag = await abada(engine.address, "instances", "--token", "nobody-knows-me", env={"ABADA_TOKEN": ""})
    assert flag.exit_code == 1
    assert flag.stderr.strip() == (
        f"error: the engine at {engine.address} does not know the token from --token (UNAUTHENTICATED)"
    )
    stale = tmp_path / "stale.token"
    stale.write_text("nobody-knows-me\n")
    from_file = await abada(engine.address, "instances", "--token-file", str(stale), env={"ABADA_TOKEN": ""})
    assert from_file.stderr.strip().endswith(
        f"does not know the token from --token-file {stale} (UNAUTHENTICATED)"
    )
    from_env = await abada(
        engine.address, "instances", env={"ABADA_TOKEN": "", "ABADA_TOKEN_FILE": str(stale)}
    )
    assert from_env.stderr.strip().endswith(
        f"does not know the token from ABADA_TOKEN_FILE {stale} (UNAUTHENTICATED)"
    )


async def test_deploy_against_a_server_refusing_the_credential_says_so(
    engine, crm, deploy_credentials, tmp_path
):
    deploy_credentials.write_text("crm-token: stale\n")
    bundle = tmp_path / "crm.yaml"
    bundle.write_text(
        f"""
tool_servers:
  - name: crm
    transport: streamable-http
    url: {crm.url}
    credential: crm-token
    tools:
      get_customer: {{ policy: read }}
processes:
  - id: lookup
    start: done
    nodes:
      - {{ id: done, type: end }}
"""
    )
    ran = await abada(engine.address, "deploy", str(bundle))
    assert ran.exit_code == 1
    assert ran.stderr.startswith("error: TOOL_SERVER_UNAUTHORIZED: tool server 'crm' at ")
    assert "answered 401 Unauthorized: it refused the credential 'crm-token'" in ran.stderr
    assert "unreachable" not in ran.stderr


async def test_tables_fit_the_terminal_width_but_keep_ids_whole(engine):
    await deploy(engine, BUNDLE)
    instance = await start(engine, "notify", message="x" * 300)
    wide = await abada(engine.address, "show", instance.id, env={"COLUMNS": "80"})
    history = wide.stdout.split("history:\n", 1)[1].splitlines()
    assert all(len(line) <= 80 for line in history), history
    listed = await abada(engine.address, "instances", env={"COLUMNS": "80"})
    assert all(len(line) <= 80 for line in listed.stdout.splitlines())
    assert instance.id in listed.stdout
    piped = await abada(engine.address, "show", instance.id)
    assert any(len(line) > 80 for line in piped.stdout.splitlines())  # a pipe gets everything


def test_every_program_prints_its_version():
    for program in ("abada", "abada-engine", "abada-broker", "abada-worker"):
        done = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), program), "--version"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"{program} 0.1.0"


def test_shell_completion_is_on():
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "abada")],
        env={**os.environ, "_ABADA_COMPLETE": "complete_bash", "COMP_WORDS": "abada can", "COMP_CWORD": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["cancel"]
