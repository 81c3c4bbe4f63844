"""An invoice of 200 lines fanned out to an agent node, with a worker and then the engine SIGKILLed
mid-flight.

Each line is an item of its own (`for_each`, `max_concurrency: 20`): the scripted model opens one CRM
ticket for it (a keyed write) and answers with the ticket and the line. Three workers each take one
item and SIGKILL themselves in its middle, at a step boundary (ABADA_WORKER_FAULT, test only): after
its model turn was journaled, after its ticket's write was sent (the CRM's answer arrived, nothing
journaled), after the write was journaled. Their items come back when their leases lapse; two healthy
workers take the rest, and the engine is SIGKILLed after half the tickets (started again on the same
address). Afterwards every line's answer is in `collect`, in the invoice's order; no line ran twice
(one ticket each, each line's two turns played once); no model turn was paid twice; no idempotency key
was used twice.

(A worker killed while a model call is on its way pays for that turn again when its item is taken
over: no journal can hold an answer that never reached it. So the workers die at step boundaries.)
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from abada.engine.v1 import process_pb2, process_pb2_grpc
from fault_stack import TOOL_ARGUMENT_MARKER, deploy, running_stack, wait_for
from google.protobuf import json_format, struct_pb2
from scripted_gemini.testing import fetch_calls

LINES = 200
CONCURRENCY = 20
LEASE_MS = 2_000  # the killed worker's items come back after this
OUTAGE_SECONDS = 2.0
BOUNDARIES = ["kill-at:model-returned", "kill-after-send:crm/create_ticket", "kill-at:write-returned"]


def invoice_bundle(crm_url: str) -> str:
    return f"""
tool_servers:
  - name: crm
    transport: streamable-http
    url: {crm_url}
    credential: crm-token
    tools:
      create_ticket: {{ policy: write, idempotency: key }}
processes:
  - id: disputed_invoice
    start: triage_line
    nodes:
      - id: triage_line
        type: agent
        model: gemini-3.6-flash
        prompt: Open a ticket for this disputed invoice line and answer in JSON.
        for_each: ${{lines}}
        as: line
        max_concurrency: {CONCURRENCY}
        inputs: {{ customerId: "${{customerId}}", line: "${{line}}" }}
        tools: [crm/create_ticket]
        result_variable: verdict
        collect: verdicts
        output_schema: {{ type: object, required: [ticketId, line] }}
        limits: {{ max_model_calls: 4, max_tool_calls: 2 }}
        next: done
      - {{ id: done, type: end }}
"""


def invoice_script() -> dict[str, object]:
    """Two turns a line: open a ticket whose subject is the line, then answer with it."""
    return {
        "scripts": [
            {
                "name": "invoice_line",
                "turns": [
                    {
                        "call": {
                            "name": "crm__create_ticket",
                            "args": {
                                "customerId": "{{input.customerId}}",
                                "subject": "{{input.line}}" + TOOL_ARGUMENT_MARKER,
                                "priority": "normal",
                            },
                        }
                    },
                    {"json": {"ticketId": "{{tool.crm__create_ticket.ticketId}}", "line": "{{input.line}}"}},
                ],
            }
        ]
    }


def line_text(number: int) -> str:
    return f"Invoice INV-2207 line {number:03d}: disputed amount"


async def instance_state(channel, instance_id: str) -> process_pb2.Instance:  # type: ignore[no-untyped-def]
    stub = process_pb2_grpc.ProcessServiceStub(channel)
    return (
        await stub.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id), timeout=5)
    ).instance


# Room for the completion's own wait to run out and print what the stack was doing, on a loaded host.
@pytest.mark.timeout(480)
async def test_a_fan_out_of_200_lines_survives_a_worker_and_the_engine_killed_mid_flight(
    tmp_path, shared_database, crm, gemini_url
):
    lines = [line_text(n) for n in range(LINES)]
    async with running_stack(tmp_path, shared_database, crm, gemini_url, script=invoice_script()) as stack:
        before = {t["ticketId"] for t in crm.tickets()}

        def ours() -> list[dict[str, object]]:
            return [t for t in crm.tickets() if t["ticketId"] not in before]

        async with stack.engine.channel() as channel:
            await deploy(channel, invoice_bundle(crm.url))
            variables = struct_pb2.Struct()
            variables.update({"customerId": "C-42", "lines": lines})
            started = await process_pb2_grpc.ProcessServiceStub(channel).StartInstance(
                process_pb2.StartInstanceRequest(process_id="disputed_invoice", variables=variables),
                timeout=10,
            )
        instance_id = started.instance.id
        # Each doomed worker holds one item and dies in its middle; the items come back after the lease.
        doomed = [
            stack.add_worker(f"doomed-{n}", extra={"ABADA_WORKER_FAULT": b}, concurrency=1, lease_ms=LEASE_MS)
            for n, b in enumerate(BOUNDARIES)
        ]
        for worker in doomed:
            await wait_for(lambda w=worker: not w.running, f"{worker.name} killed at its boundary", 90)
        for name in ("w0", "w1"):
            stack.add_worker(name, concurrency=CONCURRENCY // 2, lease_ms=LEASE_MS)

        await wait_for(lambda: len(ours()) >= LINES // 2, "half of the tickets", 90, 0.02)
        stack.engine.kill()
        await asyncio.sleep(OUTAGE_SECONDS)  # the outage itself, not a wait for a condition
        await stack.engine.start()

        channel = stack.engine.channel()
        try:

            async def completed() -> process_pb2.Instance | None:
                found = await instance_state(channel, instance_id)
                return found if found.state == process_pb2.INSTANCE_STATE_COMPLETED else None

            try:
                finished = await wait_for(completed, "the fan-out completed", 300, 0.5)
            except AssertionError as error:
                where = await instance_state(channel, instance_id)
                raise AssertionError(f"{error}\n{where.fan_outs}\n{stack.logs()}") from None
            # The engine's own account: each item completed once, whoever finished it.
            history = await process_pb2_grpc.ProcessServiceStub(channel).GetHistory(
                process_pb2.GetHistoryRequest(instance_id=instance_id), timeout=10
            )
        finally:
            await channel.close()
        completions = Counter(e.task_id for e in history.events if e.type == "TASK_COMPLETED")
        assert len(completions) == LINES and set(completions.values()) == {1}
        (fan_out,) = finished.fan_outs
        assert (fan_out.state, fan_out.items_total, fan_out.items_done) == ("COMPLETED", LINES, LINES)

        # Every line's answer in `collect`, in the invoice's order.
        verdicts = json_format.MessageToDict(finished.variables)["verdicts"]
        assert [verdict["line"] for verdict in verdicts] == lines

        # No line ran twice: one ticket a line, the ticket its answer names.
        tickets = ours()
        per_line = Counter(str(t["subject"]).removesuffix(TOOL_ARGUMENT_MARKER) for t in tickets)
        assert sorted(per_line.values()) == [1] * LINES and set(per_line) == set(lines), per_line.most_common(
            3
        )
        ticket_of_line = {
            str(t["subject"]).removesuffix(TOOL_ARGUMENT_MARKER): t["ticketId"] for t in tickets
        }
        assert [verdict["ticketId"] for verdict in verdicts] == [ticket_of_line[line] for line in lines]
        keys = Counter(t.get("idempotencyKey") for t in tickets)
        assert None not in keys and max(keys.values()) == 1

        # No model turn paid twice: each line's conversation played its two turns once each.
        calls = fetch_calls(gemini_url)
        assert calls["repeated"] == [], calls["repeated"][:3]
        assert sum(entry["count"] for entry in calls["counts"]) == 2 * LINES
