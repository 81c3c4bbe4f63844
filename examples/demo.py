"""`make demo`: Alice's support triage end to end, offline, printing what happened.

Starts PostgreSQL (embedded, unless ABADA_DATABASE_URL is set), the engine, the credential broker
(file backend), the demo CRM MCP server, the scripted endpoint of the chosen provider (or the
provider itself when its API key is set) and one agent worker; deploys examples/support-triage.yaml
with that provider's model; starts Alice's instance; prints the journal, the ticket, the `triage`
variable and where the token went. Then, on the scripted Gemini endpoint, the same triage with
create_ticket under a person's approval (examples/support-triage-approval.yaml): the task parks,
`abada approvals` shows the proposed call, `abada approve` decides it (with an edited priority),
and the ticket is opened as approved. Then it stops everything it started.

    python examples/demo.py [--provider gemini|openai|anthropic]     # make demo PROVIDER=openai
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import grpc
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    incident_pb2,
    incident_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
)
from abada_engine.devstack.processes import StartupFailed
from abada_engine.devstack.stack import PROVIDERS, DevPorts, ModelProvider, running_stack
from google.protobuf import json_format, struct_pb2

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "examples" / "support-triage.yaml"
APPROVAL_BUNDLE = ROOT / "examples" / "support-triage-approval.yaml"
BUNDLE_URL = "http://127.0.0.1:8765/mcp"
BUNDLE_MODEL = "model: gemini-3.6-flash"


def say(text: str = "") -> None:
    print(text, flush=True)


def plain(message: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as JSON values, whole numbers as ints (Struct carries every number as a double)."""

    def integral(value: Any) -> Any:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, dict):
            return {k: integral(v) for k, v in value.items()}
        if isinstance(value, list):
            return [integral(v) for v in value]
        return value

    return integral(json_format.MessageToDict(message))


def summary(value: Any, width: int = 96) -> str:
    text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
    return text if len(text) <= width else text[: width - 1] + "…"


@dataclasses.dataclass(frozen=True)
class DemoCrm:
    url: str  # the MCP endpoint
    token: str

    def tickets(self) -> list[dict[str, Any]]:
        """GET /tickets: every ticket the CRM holds, with the idempotency key it was created under."""
        request = urllib.request.Request(
            self.url.removesuffix("/mcp") + "/tickets", headers={"Authorization": f"Bearer {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            tickets: list[dict[str, Any]] = json.loads(response.read())
            return tickets


def run(provider: ModelProvider) -> int:
    """The stack `abada dev` runs, in a temporary directory on free ports, then the scenario."""
    with tempfile.TemporaryDirectory(prefix="abada-demo-") as scratch:
        try:
            with running_stack(pathlib.Path(scratch), DevPorts.any_free(), provider, say) as stack:
                say()
                operator = stack.identities.token(stack.identities.operator_token_file)
                crm = DemoCrm(stack.crm_url, stack.identities.crm_token())
                with grpc.insecure_channel(stack.engine_address) as channel:
                    outcome = triage(channel, operator, crm, stack.logs, provider)
                    if outcome == 0 and stack.model_url is not None and provider.name == "gemini":
                        # the approval part plays a scripted Gemini conversation
                        say()
                        outcome = approved_triage(
                            channel,
                            operator,
                            stack.engine_address,
                            stack.identities.approver_token_file,
                            crm,
                            stack.logs,
                        )
        except StartupFailed as error:
            raise SystemExit(str(error)) from None
    if outcome == 0:
        say(
            "\nNext: `abada dev` runs this stack until Ctrl-C, keeping its data; try it yourself (README: The CLI),"
            " or in the web console at the `console` address it prints (docs/console.md)."
        )
    return outcome


def until_past(
    processes: process_pb2_grpc.ProcessServiceStub,
    auth: tuple[tuple[str, str], ...],
    instance_id: str,
    nodes: tuple[str, ...],
    timeout: float = 90,
) -> process_pb2.Instance:
    """The instance once its token left `nodes` (or it ended, or an incident holds it, or `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        instance = processes.GetInstance(
            process_pb2.GetInstanceRequest(instance_id=instance_id), metadata=auth
        ).instance
        if instance.state != process_pb2.INSTANCE_STATE_ACTIVE or instance.open_incidents:
            return instance
        if instance.current_node_id not in nodes or time.monotonic() > deadline:
            return instance
        time.sleep(0.3)


def triage(
    channel: grpc.Channel, operator: str, crm: Any, logs: pathlib.Path, provider: ModelProvider
) -> int:
    auth = (("authorization", f"Bearer {operator}"),)
    definitions = definition_pb2_grpc.DefinitionServiceStub(channel)
    processes = process_pb2_grpc.ProcessServiceStub(channel)
    tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
    incidents = incident_pb2_grpc.IncidentServiceStub(channel)

    bundle = BUNDLE.read_text().replace(BUNDLE_URL, crm.url).replace(BUNDLE_MODEL, f"model: {provider.model}")
    deployed = definitions.Deploy(
        definition_pb2.DeployRequest(source_name=BUNDLE.name, content=bundle), metadata=auth
    ).definitions[0]
    say(f"deployed {deployed.process_id} v{deployed.version}; frozen tool bindings:")
    for binding in deployed.tool_bindings:
        say(
            f"  {binding.server}/{binding.tool:<14} {common_policy(binding)}  schema sha256 "
            f"{binding.input_schema_sha256[:12]}…"
        )

    variables = struct_pb2.Struct()
    variables.update({"customerId": "C-42", "message": "My parcel never arrived"})
    instance = processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id="support_triage", variables=variables), metadata=auth
    ).instance
    say(f'\nstarted instance {instance.id} for C-42: "My parcel never arrived"')

    instance = until_past(processes, auth, instance.id, ("triage", "notify_customer"))
    if instance.current_node_id == "customer_reply":
        # The instance waits for Alice's answer, correlated on her ticket: the demo plays the helpdesk's
        # webhook and publishes it (as `abada publish` would).
        ticket = str(plain(instance.variables).get("triage", {}).get("ticketId", ""))
        say(f"\nwaiting at customer_reply for a customer_reply message with key {ticket} (up to P2D)")
        reply = struct_pb2.Struct()
        reply.update({"text": "It arrived this morning, thank you!"})
        published = processes.PublishMessage(
            process_pb2.PublishMessageRequest(
                name="customer_reply", correlation_key=ticket, variables=reply, message_id=f"mail-{ticket}"
            ),
            metadata=auth,
        )
        said = f"correlated to instance {published.instance_id}" if published.correlated else "buffered"
        say(f"published customer_reply for {ticket}: {said}")
        instance = until_past(processes, auth, instance.id, ("customer_reply",))
    history = processes.GetHistory(
        process_pb2.GetHistoryRequest(instance_id=instance.id), metadata=auth
    ).events
    agent_task = next((e.task_id for e in history if e.type == "TASK_CREATED" and e.node_id == "triage"), "")
    if agent_task:
        say(f"\njournal of task {agent_task}:")
        for step in tasks.GetJournal(
            external_task_pb2.GetJournalRequest(task_id=agent_task), metadata=auth
        ).steps:
            kind = external_task_pb2.StepKind.Name(step.kind).removeprefix("STEP_KIND_")
            state = external_task_pb2.StepState.Name(step.state).removeprefix("STEP_STATE_")
            what = step.tool_ref or "model"
            tokens = (
                f" tokens {step.tokens.input_tokens}+{step.tokens.output_tokens}"
                if kind == "MODEL_CALL"
                else ""
            )
            key = f" key {step.idempotency_key[:18]}…" if step.idempotency_key else ""
            say(f"  {step.sequence}. attempt {step.attempt} {kind:<10} {state:<9} {what}{tokens}{key}")
            if step.HasField("response"):
                say(f"       → {summary(plain(step.response))}")

    tickets = crm.tickets()
    say("\nCRM tickets:")
    for ticket in tickets:
        say(
            f"  {ticket.get('ticketId')}  {ticket.get('customerId')}  {ticket.get('priority')}  "
            f"{ticket.get('subject')!r}  key {str(ticket.get('idempotencyKey'))[:18]}…"
        )
    values = plain(instance.variables)
    say(f"\ntriage = {json.dumps(values.get('triage'), ensure_ascii=False)}")
    completed = next((e for e in history if e.type == "TASK_COMPLETED" and e.node_id == "triage"), None)
    if completed is not None:
        say(f"attempt metadata = {summary(plain(completed.data).get('metadata'), 200)}")
    if values.get("reply") is not None:
        say(f"reply = {json.dumps(values['reply'], ensure_ascii=False)}")
    notification = values.get("notification")
    if notification is not None:
        say(
            f"\nnotify worker: {notification.get('channel')} to {notification.get('to')}: {notification.get('text')!r}"
        )
        for line in (logs / "notify-worker.log").read_text(errors="replace").splitlines():
            if " notify: " in line:
                say(f"  its log: {line.split(' notify: ', 1)[1]}")
    state = process_pb2.InstanceState.Name(instance.state).removeprefix("INSTANCE_STATE_")
    say(f"\ninstance {instance.id} is {state}; the token is at: {instance.current_node_id}")
    open_incidents = incidents.ListIncidents(
        incident_pb2.ListIncidentsRequest(instance_id=instance.id), metadata=auth
    ).incidents
    for incident in open_incidents:
        say(f"open incident {incident.type}: {incident.message}")
    ok = (
        instance.state == process_pb2.INSTANCE_STATE_COMPLETED
        and instance.current_node_id == "done"
        and len(tickets) == 1
        and not open_incidents
    )
    say(
        "\n"
        + (
            "demo finished: the model reasoned, the worker acted, the engine decided."
            if ok
            else f"demo did not complete at done; the logs are in {logs} until this exits"
        )
    )
    return 0 if ok else 1


def approved_triage(
    channel: grpc.Channel,
    operator: str,
    engine_address: str,
    approver_token: pathlib.Path,
    crm: Any,
    logs: pathlib.Path,
) -> int:
    """The same triage with create_ticket under approval: the task parks until a person decides."""
    auth = (("authorization", f"Bearer {operator}"),)
    definitions = definition_pb2_grpc.DefinitionServiceStub(channel)
    processes = process_pb2_grpc.ProcessServiceStub(channel)
    approvals = approval_pb2_grpc.ApprovalServiceStub(channel)
    tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
    bundle = APPROVAL_BUNDLE.read_text().replace(BUNDLE_URL, crm.url)
    deployed = definitions.Deploy(
        definition_pb2.DeployRequest(source_name=APPROVAL_BUNDLE.name, content=bundle), metadata=auth
    ).definitions[0]
    say(f"--- a person approves the write: deployed {deployed.process_id} v{deployed.version}")
    for binding in deployed.tool_bindings:
        approval = "  approval: required" if binding.approval_required else ""
        say(f"  {binding.server}/{binding.tool:<14} {common_policy(binding)}{approval}")
    tickets_before = len(crm.tickets())
    variables = struct_pb2.Struct()
    variables.update({"customerId": "C-42", "message": "My parcel never arrived"})
    instance = processes.StartInstance(
        process_pb2.StartInstanceRequest(
            process_id=deployed.process_id, variables=variables, business_key="C-42/parcel"
        ),
        metadata=auth,
    ).instance
    say(f"\nstarted instance {instance.id} for C-42 (business key C-42/parcel)")

    deadline = time.monotonic() + 90
    pending: list[Any] = []
    while not pending and time.monotonic() < deadline:
        pending = list(
            approvals.ListApprovals(
                approval_pb2.ListApprovalsRequest(business_key="C-42/parcel"), metadata=auth
            ).approvals
        )
        time.sleep(0.3)
    if not pending:
        say(f"no approval was asked for; the logs are in {logs} until this exits")
        return 1
    say(f"the model asked for {pending[0].tool_ref}; the task is parked (no lease, no credential) and waits.")
    say(f"tickets opened meanwhile: {len(crm.tickets()) - tickets_before}")
    cli = [
        sys.executable,
        "-m",
        "abada_engine.cli",
        "--engine",
        engine_address,
        "--token-file",
        str(approver_token),
    ]
    say("\n$ abada approvals")
    say(subprocess.run([*cli, "approvals"], capture_output=True, text=True, check=True).stdout.rstrip())
    edited = {**plain(pending[0].arguments), "priority": "urgent"}
    say(f"\n$ abada approve {pending[0].id} --args '{json.dumps(edited)}' --comment 'gold customer: urgent'")
    approve = [
        *cli,
        "approve",
        pending[0].id,
        "--args",
        json.dumps(edited),
        "--comment",
        "gold customer: urgent",
    ]
    say(subprocess.run(approve, capture_output=True, text=True, check=True).stdout.rstrip())

    while time.monotonic() < deadline:
        instance = processes.GetInstance(
            process_pb2.GetInstanceRequest(instance_id=instance.id), metadata=auth
        ).instance
        if instance.current_node_id != "triage" or instance.open_incidents:
            break
        time.sleep(0.3)
    history = processes.GetHistory(
        process_pb2.GetHistoryRequest(instance_id=instance.id), metadata=auth
    ).events
    agent_task = next((e.task_id for e in history if e.type == "TASK_CREATED" and e.node_id == "triage"), "")
    say(f"\njournal of task {agent_task}:")
    for step in tasks.GetJournal(
        external_task_pb2.GetJournalRequest(task_id=agent_task), metadata=auth
    ).steps:
        kind = external_task_pb2.StepKind.Name(step.kind).removeprefix("STEP_KIND_")
        state = external_task_pb2.StepState.Name(step.state).removeprefix("STEP_STATE_")
        say(f"  {step.sequence}. attempt {step.attempt} {kind:<10} {state:<17} {step.tool_ref or 'model'}")
    for event in history:
        if event.type.startswith("APPROVAL_"):
            data = plain(event.data)
            who = f" by {data['decided_by']}: {data.get('comment', '')!r}" if "decided_by" in data else ""
            say(f"history: {event.type} {data.get('tool_ref', '')}{who}")
    new = crm.tickets()[tickets_before:]
    for ticket in new:
        say(f"CRM ticket: {ticket.get('ticketId')}  {ticket.get('priority')}  {ticket.get('subject')!r}")
    say(f"triage = {json.dumps(plain(instance.variables).get('triage'), ensure_ascii=False)}")
    say(f"the token is at: {instance.current_node_id} ({process_pb2.InstanceState.Name(instance.state)})")
    ok = len(new) == 1 and new[0].get("priority") == "urgent" and instance.current_node_id == "done"
    say(
        "\n"
        + (
            "demo finished: the call waited for a person, ran once as approved, and the engine decided."
            if ok
            else f"the approval part did not finish as expected; the logs are in {logs} until this exits"
        )
    )
    return 0 if ok else 1


def common_policy(binding: Any) -> str:
    from abada.engine.v1 import common_pb2

    policy = common_pb2.ToolPolicy.Name(binding.policy).removeprefix("TOOL_POLICY_").lower()
    idempotency = common_pb2.Idempotency.Name(binding.idempotency).removeprefix("IDEMPOTENCY_").lower()
    return f"{policy:<5} idempotency {idempotency}" if policy == "write" else f"{policy:<5}"


def main() -> int:
    parser = argparse.ArgumentParser(description="Alice's support triage end to end, offline.")
    parser.add_argument(
        "--provider",
        choices=sorted(PROVIDERS),
        default=os.environ.get("PROVIDER") or "gemini",
        help="which model provider serves the agent node (PROVIDER)",
    )
    return run(PROVIDERS[parser.parse_args().provider])


if __name__ == "__main__":
    raise SystemExit(main())
