"""A `for_each` agent node's $0.50 budget, shared by its items, met by real agent workers.

20 invoice lines, 10 at once, on two agent workers; every scripted model turn costs exactly $0.04
(800 prompt tokens at $50 a million). The engine refuses the call that would pass $0.50, whichever
item makes it: the model plays no more turns than the budget pays for, one LIMIT_EXCEEDED incident
holds the node, the other items stop without incidents of their own, and nothing is left leased.
"""

from __future__ import annotations

from abada.engine.v1 import incident_pb2, incident_pb2_grpc, process_pb2, process_pb2_grpc
from fault_stack import deploy, running_stack, wait_for
from google.protobuf import struct_pb2
from scripted_gemini.testing import fetch_calls
from test_fan_out_crash import LEASE_MS, invoice_bundle, invoice_script, line_text

LINES = 20
AT_ONCE = 10
TURN_USD = 0.04  # 800 prompt tokens at $50 a million
BUDGET_USD = 0.50


def budgeted_bundle(crm_url: str) -> str:
    priced = (
        "models:\n  - { name: gemini-3.6-flash, provider: gemini, price: { input_per_million_usd: 50 } }\n"
    )
    return priced + invoice_bundle(crm_url).replace(
        "max_concurrency: 20", f"max_concurrency: {AT_ONCE}"
    ).replace(
        "limits: { max_model_calls: 4, max_tool_calls: 2 }",
        f"limits: {{ max_model_calls: 4, max_tool_calls: 2, max_cost_usd: {BUDGET_USD} }}",
    )


def priced_script() -> dict[str, object]:
    script = invoice_script()
    for turn in script["scripts"][0]["turns"]:  # type: ignore[index]
        turn["usage"] = {"prompt_tokens": 800, "candidates_tokens": 0}
    return script


async def test_a_shared_budget_stops_real_workers_with_one_incident(
    tmp_path, shared_database, crm, gemini_url
):
    async with running_stack(tmp_path, shared_database, crm, gemini_url, script=priced_script()) as stack:
        channel = stack.engine.channel()
        try:
            await deploy(channel, budgeted_bundle(crm.url))
            variables = struct_pb2.Struct()
            variables.update({"customerId": "C-42", "lines": [line_text(n) for n in range(LINES)]})
            processes = process_pb2_grpc.ProcessServiceStub(channel)
            started = await processes.StartInstance(
                process_pb2.StartInstanceRequest(process_id="disputed_invoice", variables=variables),
                timeout=10,
            )
            instance_id = started.instance.id
            for name in ("w0", "w1"):
                stack.add_worker(name, concurrency=AT_ONCE // 2, lease_ms=LEASE_MS)

            async def settled() -> process_pb2.Instance | None:
                found = (
                    await processes.GetInstance(
                        process_pb2.GetInstanceRequest(instance_id=instance_id), timeout=5
                    )
                ).instance
                (fan_out,) = found.fan_outs
                return found if fan_out.items_failed > 0 and fan_out.items_running == 0 else None

            try:
                found = await wait_for(settled, "the fan-out stopped by its budget", 90, 0.3)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{stack.logs()}") from None
            listed = await incident_pb2_grpc.IncidentServiceStub(channel).ListIncidents(
                incident_pb2.ListIncidentsRequest(
                    instance_id=instance_id, state=incident_pb2.INCIDENT_STATE_OPEN
                )
            )
            history = await processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id))
        finally:
            await channel.close()

        (incident,) = listed.incidents
        assert (incident.type, incident.node_id) == ("LIMIT_EXCEEDED", "triage_line")
        assert "max_cost_usd $0.5" in incident.message
        (fan_out,) = found.fan_outs
        assert fan_out.state == "RUNNING" and fan_out.items_done < LINES
        stopped = sum(1 for event in history.events if event.type == "ITEM_STOPPED")
        assert fan_out.items_failed == 1 + stopped
        # The model played no more turns than $0.50 pays for.
        played = sum(entry["count"] for entry in fetch_calls(gemini_url)["counts"])
        assert 0 < played * TURN_USD <= BUDGET_USD + 1e-9, played
        print(
            f"\nfan-out budget: {played} turns (${played * TURN_USD:.2f}), {fan_out.items_done} items done, "
            f"{fan_out.items_failed} stopped, 1 incident"
        )
