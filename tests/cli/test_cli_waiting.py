"""`abada publish`, `abada instances --waiting-for` and the waits `abada show` prints."""

from __future__ import annotations

from cli_support import abada
from engine_helpers import deploy, start

FLOWS = """
processes:
  - id: reply
    start: await_reply
    nodes:
      - id: await_reply
        type: receive
        message: customer_reply
        correlation_key: "${ticketId}"
        result_variable: reply
        next: done
      - { id: done, type: end }
  - id: pause
    start: wait
    nodes:
      - { id: wait, type: timer, duration: PT1H, next: done }
      - { id: done, type: end }
"""


async def test_publish_correlates_to_the_waiting_instance_and_says_so(engine):
    await deploy(engine, FLOWS)
    waiting = await start(engine, "reply", ticketId="T-9")
    paused = await start(engine, "pause")

    listed = await abada(engine.address, "-o", "json", "instances", "--waiting-for", "message")
    assert [i["id"] for i in listed.json()["instances"]] == [waiting.id]
    listed = await abada(engine.address, "-o", "json", "instances", "--waiting-for", "timer")
    assert [i["id"] for i in listed.json()["instances"]] == [paused.id]

    shown = await abada(engine.address, "show", waiting.id)
    assert "MESSAGE" in shown.stdout and "customer_reply (key T-9)" in shown.stdout

    ran = await abada(
        engine.address,
        "-o",
        "json",
        "publish",
        "customer_reply",
        "--correlation-key",
        "T-9",
        "--var",
        "text=it arrived",
        "--ttl",
        "PT1H",
        "--message-id",
        "mail-1",
    )
    assert ran.exit_code == 0, ran.stderr
    assert ran.json()["correlated"] is True and ran.json()["instanceId"] == waiting.id

    again = await abada(
        engine.address,
        "publish",
        "customer_reply",
        "--correlation-key",
        "T-9",
        "--ttl",
        "PT1H",
        "--message-id",
        "mail-1",
    )
    assert again.exit_code == 0
    assert "already published" in again.stdout and waiting.id in again.stdout

    buffered = await abada(
        engine.address, "publish", "customer_reply", "--correlation-key", "T-10", "--ttl", "PT1M"
    )
    assert "buffered" in buffered.stdout


async def test_publish_refuses_a_ttl_that_is_not_a_duration(engine):
    ran = await abada(
        engine.address, "publish", "customer_reply", "--correlation-key", "T-1", "--ttl", "an hour"
    )
    assert ran.exit_code != 0
    assert "--ttl" in ran.stderr
