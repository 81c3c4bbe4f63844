"""Shared helpers for the worker's tests: agent work and journal entries built as plain data."""

from __future__ import annotations

from typing import Any

from abada_worker.work import AgentWork, JournalEntry, Limits, StepKind, StepState, ToolBinding

GET_CUSTOMER = ToolBinding(
    server="crm",
    tool="get_customer",
    is_write=False,
    keyed=False,
    url="http://127.0.0.1:1/mcp",
    transport="streamable-http",
    credential="crm-token",
    input_schema_sha256="",
)
CREATE_TICKET = ToolBinding(
    server="crm",
    tool="create_ticket",
    is_write=True,
    keyed=True,
    url="http://127.0.0.1:1/mcp",
    transport="streamable-http",
    credential="crm-token",
    input_schema_sha256="",
)
VARIABLES = {"customerId": "C-42", "message": "My parcel never arrived"}


def agent_work(*bindings: ToolBinding, output_schema: dict[str, Any] | None = None) -> AgentWork:
    return AgentWork(
        profile_version="abada.agent/v1",
        model="gemini-3.6-flash",
        provider="gemini",
        prompt="Read the message from C-42, look the customer up, open a ticket and answer in JSON.",
        bindings=bindings or (GET_CUSTOMER, CREATE_TICKET),
        limits=Limits(8, 8, 50_000),
        output_schema=output_schema,
        result_variable="triage",
        confidence_threshold=80.0,
    )


def model_step(
    sequence: int,
    calls: list[tuple[str, str, dict[str, Any]]] | None = None,
    *,
    text: str = "",
    state: StepState = StepState.COMPLETED,
    attempt: int = 1,
    abandoned: bool = False,
    tokens: tuple[int, int] = (100, 10),
) -> JournalEntry:
    response: dict[str, Any] = {}
    if state is StepState.COMPLETED:
        response = {
            "text": text,
            "functionCalls": [{"id": i, "name": n, "args": a} for i, n, a in calls or []],
            "finishReason": "STOP",
        }
    return JournalEntry(
        sequence=sequence,
        attempt=attempt,
        kind=StepKind.MODEL_CALL,
        state=state,
        tool_ref="",
        request={"turn": 0, "model": "gemini-3.6-flash", "provider": "gemini"},
        response=response,
        input_tokens=tokens[0] if state is StepState.COMPLETED else 0,
        output_tokens=tokens[1] if state is StepState.COMPLETED else 0,
        idempotency_key="",
        abandoned=abandoned,
    )


def tool_step(
    sequence: int,
    call_id: str,
    binding: ToolBinding,
    *,
    state: StepState = StepState.COMPLETED,
    result: dict[str, Any] | None = None,
    key: str = "",
    attempt: int = 1,
    abandoned: bool = False,
) -> JournalEntry:
    finished = state in (StepState.COMPLETED, StepState.FAILED)
    return JournalEntry(
        sequence=sequence,
        attempt=attempt,
        kind=StepKind.TOOL_CALL,
        state=state,
        tool_ref=binding.ref,
        request={"callId": call_id, "name": f"crm__{binding.tool}", "arguments": {"customerId": "C-42"}},
        response=(result or {"content": [], "structuredContent": {"ok": True}, "isError": False})
        if finished
        else {},
        input_tokens=0,
        output_tokens=0,
        idempotency_key=key,
        abandoned=abandoned,
    )


async def deploy_bundle(engine: Any, content: str) -> None:
    from abada.engine.v1 import definition_pb2

    await engine.definitions.Deploy(
        definition_pb2.DeployRequest(source_name="worker-test.yaml", content=content)
    )


async def start_instance(engine: Any, process_id: str, **variables: Any) -> str:
    from abada.engine.v1 import process_pb2
    from google.protobuf import struct_pb2

    values = struct_pb2.Struct()
    values.update(variables)
    response = await engine.processes.StartInstance(
        process_pb2.StartInstanceRequest(process_id=process_id, variables=values)
    )
    return str(response.instance.id)


async def instance_of(engine: Any, instance_id: str) -> Any:
    from abada.engine.v1 import process_pb2

    return (
        await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=instance_id))
    ).instance


async def history_of(engine: Any, instance_id: str) -> list[Any]:
    from abada.engine.v1 import process_pb2

    return list(
        (await engine.processes.GetHistory(process_pb2.GetHistoryRequest(instance_id=instance_id))).events
    )
