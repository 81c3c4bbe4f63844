"""Helpers for engine tests: reading rich gRPC errors, deploying, a minimal test worker."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import grpc
from abada.engine.v1 import definition_pb2, external_task_pb2, lease_pb2, lease_pb2_grpc, process_pb2
from google.protobuf import json_format, struct_pb2
from google.rpc import error_details_pb2, status_pb2

# A process with one service task on topic `jobs`: the smallest thing a worker can fetch and complete.
ONE_SERVICE_TASK = """
processes:
  - id: job
    start: work
    nodes:
      - { id: work, type: service, topic: jobs, next: done }
      - { id: done, type: end }
"""

# One agent task (topic abada:agent) that may make one model call and no tool call.
ONE_AGENT_TASK = """
processes:
  - id: think
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: think
        result_variable: answer
        limits: { max_model_calls: 1, max_tool_calls: 0, max_tokens: 1000 }
        next: done
      - { id: done, type: end }
"""


def support_triage(
    crm_url: str,
    *,
    model: str = "gemini-3.6-flash",
    idempotency: str = "key",
    approval: bool = False,
    review_on: tuple[str, ...] = ("invalid_output", "low_confidence"),
    node_extra: str = "",
) -> str:
    """Alice's support triage (docs/scenario.md): an agent node reading the customer and opening a
    ticket with the CRM's tools, then `notify_customer`. Each reason in `review_on` routes the answer to
    a person's `review` task instead of an incident (none: no review task); `approval` puts
    create_ticket under a person's approval; `node_extra` adds lines to the agent node."""
    write = f"policy: write, idempotency: {idempotency}" + (", approval: required" if approval else "")
    routes = "".join(f"on_{reason}: review\n        " for reason in review_on)
    if node_extra:
        routes += f"{node_extra}\n        "
    review = "\n      - { id: review, type: user_task, next: done }" if review_on else ""
    tools = crm_tool_server(crm_url, {"get_customer": "{ policy: read }", "create_ticket": f"{{ {write} }}"})
    return (
        tools
        + f"""processes:
  - id: support_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: {model}
        prompt: Read the message from ${{customerId}}, look the customer up, open a ticket and answer in JSON.
        inputs: {{ customerId: "${{customerId}}", message: "${{message}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        output_schema: {{ type: object, required: [ticketId, priority] }}
        confidence_threshold: 80
        limits: {{ max_model_calls: 8, max_tool_calls: 8, max_tokens: 50000 }}
        {routes}next: notify_customer
      - {{ id: notify_customer, type: service, topic: notify, next: done }}{review}
      - {{ id: done, type: end }}
"""
    )


def crm_tool_server(crm_url: str, tools: dict[str, str]) -> str:
    """A bundle's `tool_servers` section with the demo CRM alone, each tool with its YAML flow mapping
    (`{"get_customer": "{ policy: read }"}`): the lines a bundle with processes goes on from."""
    lines = "".join(f"      {name}: {spec}\n" for name, spec in tools.items())
    return (
        "tool_servers:\n  - name: crm\n    transport: streamable-http\n"
        f"    url: {crm_url}\n    credential: crm-token\n    tools:\n{lines}"
    )


async def verify_lease(
    engine: Any, task: external_task_pb2.ExternalTask, worker_id: str = "w", server: str = "crm"
) -> lease_pb2.VerifyLeaseResponse:
    """The broker's check before it hands out `server`'s credential: the task's lease as the worker holds it."""
    return await lease_pb2_grpc.LeaseServiceStub(engine.channel).VerifyLease(
        lease_pb2.VerifyLeaseRequest(
            task_id=task.id, worker_id=worker_id, lease_token=task.lease_token, server=server
        )
    )


async def until_lease_ran_out(*tasks: external_task_pb2.ExternalTask) -> None:
    """Sleeps to the latest of the tasks' lease expiries, read from the leases themselves (not a guessed
    length), plus 50 ms: afterwards the engine (PostgreSQL's clock, the same machine's) sees them expired.
    However long the test was stalled before, this never wakes early."""
    expires = max(task.lease_expires_at.ToDatetime(tzinfo=dt.UTC) for task in tasks)
    left = (expires - dt.datetime.now(dt.UTC)).total_seconds() + 0.05
    await asyncio.sleep(max(left, 0.0))


# The smallest process with a task: one service task on topic `greetings`, then the end.
GREET = """
processes:
  - id: greet
    start: hello
    nodes:
      - { id: hello, type: service, topic: greetings, next: done }
      - { id: done, type: end }
"""


def error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo the engine attached to a failed call."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                    info = error_details_pb2.ErrorInfo()
                    detail.Unpack(info)
                    return info
    raise AssertionError(f"no ErrorInfo on {error.code()}: {error.details()}")


def bad_request(error: grpc.aio.AioRpcError) -> list[str]:
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-status-details-bin":
            for detail in status_pb2.Status.FromString(value).details:
                if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                    request = error_details_pb2.BadRequest()
                    detail.Unpack(request)
                    return [v.description for v in request.field_violations]
    return []


def struct(value: dict[str, Any]) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(value)
    return message


def plain(message: struct_pb2.Struct) -> dict[str, Any]:
    def integral(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: integral(x) for k, x in v.items()}
        if isinstance(v, list):
            return [integral(x) for x in v]
        return v

    return integral(json_format.MessageToDict(message))


async def deploy(
    engine: Any, content: str, source_name: str = "bundle.yaml"
) -> definition_pb2.DeployResponse:
    return await engine.definitions.Deploy(
        definition_pb2.DeployRequest(source_name=source_name, content=content)
    )


async def start(engine: Any, process_id: str, **variables: Any) -> process_pb2.Instance:
    response = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id=process_id, variables=struct(variables))
    )
    return response.instance


async def fetch(
    engine: Any, worker_id: str, topic: str, max_tasks: int = 1, lease_ms: int = 30_000, wait_ms: int = 0
) -> list[external_task_pb2.ExternalTask]:
    response = await engine.tasks.FetchAndLock(
        external_task_pb2.FetchAndLockRequest(
            worker_id=worker_id,
            topics=[external_task_pb2.TopicSubscription(name=topic, lease_ms=lease_ms)],
            max_tasks=max_tasks,
            wait_ms=wait_ms,
        )
    )
    return list(response.tasks)


async def complete(
    engine: Any,
    task: external_task_pb2.ExternalTask,
    worker_id: str,
    variables: dict[str, Any],
    confidence: float | None = None,
    **metadata: Any,
) -> external_task_pb2.CompleteResponse:
    meta = external_task_pb2.AttemptMetadata(**metadata)
    if confidence is not None:
        meta.confidence = confidence
    return await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id=worker_id,
            lease_token=task.lease_token,
            variables=struct(variables),
            metadata=meta,
        )
    )


async def leased(
    engine: Any, bundle: str, process_id: str, topic: str, count: int, **variables: Any
) -> list[external_task_pb2.ExternalTask]:
    """`count` instances of a one-task process started, their tasks leased by worker "w"."""
    await deploy(engine, bundle)
    for _ in range(count):
        await start(engine, process_id, **variables)
    tasks = await fetch(engine, "w", topic, max_tasks=count)
    assert len(tasks) == count
    return tasks


async def history_types(engine: Any, instance_id: str) -> list[tuple[str, str]]:
    response = await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id))
    return [(e.type, e.node_id) for e in response.events]


async def instance(engine: Any, instance_id: str) -> process_pb2.Instance:
    return (
        await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
    ).instance


def step_request(
    task: external_task_pb2.ExternalTask,
    sequence: int,
    kind: str,
    state: str,
    tool_ref: str = "",
    request: dict[str, Any] | None = None,
    response: dict[str, Any] | None = None,
    tokens: tuple[int, int] = (0, 0),
    worker_id: str = "w",
    attempt: int | None = None,
    lease_token: str | None = None,
) -> external_task_pb2.AppendStepRequest:
    message = external_task_pb2.AppendStepRequest(
        task_id=task.id,
        worker_id=worker_id,
        lease_token=task.lease_token if lease_token is None else lease_token,
        attempt=task.attempt if attempt is None else attempt,
        sequence=sequence,
        kind=getattr(external_task_pb2, f"STEP_KIND_{kind}"),
        state=getattr(external_task_pb2, f"STEP_STATE_{state}"),
        tool_ref=tool_ref,
        tokens=external_task_pb2.TokenUsage(input_tokens=tokens[0], output_tokens=tokens[1]),
    )
    if request is not None:
        message.request.CopyFrom(struct(request))
    if response is not None:
        message.response.CopyFrom(struct(response))
    return message


async def append(
    engine: Any,
    task: external_task_pb2.ExternalTask,
    sequence: int,
    kind: str,
    state: str,
    tool_ref: str = "",
    **fields: Any,
) -> external_task_pb2.AppendStepResponse:
    return await engine.tasks.AppendStep(step_request(task, sequence, kind, state, tool_ref, **fields))


async def journal(engine: Any, task_id: str) -> list[external_task_pb2.JournalStep]:
    response = await engine.tasks.GetJournal(external_task_pb2.GetJournalRequest(task_id=task_id))
    return list(response.steps)


async def upkeep_round(db: Any, thresholds: dict[str, int] | None = None) -> int:
    """One round of the queue upkeep that held its lock; the engine under test runs its own rounds, and
    a round that finds the lock taken does nothing, so it is tried again until it has its turn."""
    from abada_engine.runtime.background.queue_upkeep import QueueUpkeep

    upkeep = QueueUpkeep(db, thresholds)
    for _ in range(200):
        if (vacuumed := await upkeep.round()) is not None:
            return vacuumed
        await asyncio.sleep(0.05)
    raise AssertionError("the upkeep never had its turn")
