"""Helpers for approval tests: a task whose model proposed calls of a tool under approval, parked."""

from __future__ import annotations

from typing import Any

from abada.engine.v1 import external_task_pb2, process_pb2
from engine_helpers import append, deploy, fetch, struct

GUARDED_BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      create_ticket: {{ policy: write, idempotency: key, approval: required }}
processes:
  - id: guarded_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Open a ticket for ${{customerId}}.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/create_ticket]
        result_variable: triage
        next: done
      - {{ id: done, type: end }}
"""
PROPOSED = {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}
WORKER = "approval-test-worker"


async def parked_with_proposed_calls(
    engine: Any, crm_url: str, calls: int = 2, business_key: str = "C-42/parcel"
) -> tuple[str, list[str]]:
    """Deploys the guarded bundle, starts an instance and, as its worker, journals a model turn asking
    for `calls` tickets, each AWAITING_APPROVAL, then hands the task back: (instance id, approval ids)."""
    await deploy(engine, GUARDED_BUNDLE.format(url=crm_url))
    started = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id="guarded_triage", variables=struct({"customerId": "C-42"}), business_key=business_key
        )
    )
    [task] = await fetch(engine, WORKER, "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id=WORKER)
    function_calls = [{"id": f"c{n}", "name": "crm__create_ticket", "args": PROPOSED} for n in range(calls)]
    await append(
        engine,
        task,
        1,
        "MODEL_CALL",
        "COMPLETED",
        response={"text": "Opening a ticket.", "functionCalls": function_calls},
        worker_id=WORKER,
    )
    for n in range(calls):
        await append(
            engine,
            task,
            2 + n,
            "TOOL_CALL",
            "AWAITING_APPROVAL",
            tool_ref="crm/create_ticket",
            request={
                "callId": f"c{n}",
                "name": "crm__create_ticket",
                "arguments": PROPOSED,
                "modelText": "Opening a ticket.",
            },
            worker_id=WORKER,
        )
    parked = await engine.tasks.AwaitApproval(
        external_task_pb2.AwaitApprovalRequest(
            task_id=task.id, worker_id=WORKER, lease_token=task.lease_token
        )
    )
    return started.instance.id, list(parked.approval_ids)
