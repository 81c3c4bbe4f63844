"""What a fetched task asks for, as plain data: decoded once from protobuf so the rest stays pure."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from abada.engine.v1 import common_pb2, external_task_pb2
from abada_common.struct_codec import from_struct

AGENT_PROFILE = "abada.agent/v1"


class StepKind(enum.Enum):
    MODEL_CALL = external_task_pb2.STEP_KIND_MODEL_CALL
    TOOL_CALL = external_task_pb2.STEP_KIND_TOOL_CALL


class StepState(enum.Enum):
    STARTED = external_task_pb2.STEP_STATE_STARTED
    COMPLETED = external_task_pb2.STEP_STATE_COMPLETED
    FAILED = external_task_pb2.STEP_STATE_FAILED
    OUTCOME_UNKNOWN = external_task_pb2.STEP_STATE_OUTCOME_UNKNOWN
    AWAITING_APPROVAL = external_task_pb2.STEP_STATE_AWAITING_APPROVAL
    APPROVED = external_task_pb2.STEP_STATE_APPROVED


@dataclass(frozen=True)
class ToolBinding:
    server: str
    tool: str
    is_write: bool
    # Only meaningful for writes: the server honours an idempotency key, so a re-send is safe.
    keyed: bool
    url: str
    transport: str
    credential: str
    input_schema_sha256: str
    # A person approves every call before it runs (`approval: required`).
    needs_approval: bool = False
    # Pinned at deploy; "" for versions frozen before descriptions were pinned.
    description_sha256: str = ""

    @property
    def ref(self) -> str:
        """How the engine names the binding in the journal: `server/tool`."""
        return f"{self.server}/{self.tool}"


@dataclass(frozen=True)
class Limits:
    max_model_calls: int
    max_tool_calls: int
    max_tokens: int


@dataclass(frozen=True)
class AgentWork:
    profile_version: str
    model: str
    # Frozen by the engine with the definition version; "" from an engine older than the field.
    provider: str
    prompt: str
    bindings: tuple[ToolBinding, ...]
    limits: Limits
    output_schema: dict[str, Any] | None
    result_variable: str
    confidence_threshold: float | None

    def servers(self) -> dict[str, list[ToolBinding]]:
        """The bindings grouped by server, in the order the node lists them."""
        grouped: dict[str, list[ToolBinding]] = {}
        for binding in self.bindings:
            grouped.setdefault(binding.server, []).append(binding)
        return grouped


@dataclass(frozen=True)
class JournalEntry:
    sequence: int
    attempt: int
    kind: StepKind
    state: StepState
    tool_ref: str
    request: dict[str, Any]
    response: dict[str, Any]
    input_tokens: int
    output_tokens: int
    idempotency_key: str
    abandoned: bool


def binding_from_proto(message: common_pb2.ToolBinding) -> ToolBinding:
    return ToolBinding(
        server=message.server,
        tool=message.tool,
        is_write=message.policy == common_pb2.TOOL_POLICY_WRITE,
        keyed=message.idempotency == common_pb2.IDEMPOTENCY_KEY,
        url=message.url,
        transport=message.transport,
        credential=message.credential,
        input_schema_sha256=message.input_schema_sha256,
        needs_approval=message.approval_required,
        description_sha256=message.description_sha256,
    )


def agent_work_from_proto(message: external_task_pb2.AgentWork) -> AgentWork:
    return AgentWork(
        profile_version=message.profile_version,
        model=message.model,
        provider=message.provider,
        prompt=message.prompt,
        bindings=tuple(binding_from_proto(binding) for binding in message.tool_bindings),
        limits=Limits(
            max_model_calls=message.limits.max_model_calls,
            max_tool_calls=message.limits.max_tool_calls,
            max_tokens=message.limits.max_tokens,
        ),
        output_schema=from_struct(message.output_schema) if message.HasField("output_schema") else None,
        result_variable=message.result_variable,
        confidence_threshold=(
            message.confidence_threshold if message.HasField("confidence_threshold") else None
        ),
    )


def journal_entry_from_proto(message: external_task_pb2.JournalStep) -> JournalEntry:
    return JournalEntry(
        sequence=message.sequence,
        attempt=message.attempt,
        kind=StepKind(message.kind),
        state=StepState(message.state),
        tool_ref=message.tool_ref,
        request=from_struct(message.request),
        response=from_struct(message.response),
        input_tokens=message.tokens.input_tokens,
        output_tokens=message.tokens.output_tokens,
        idempotency_key=message.idempotency_key,
        abandoned=message.abandoned,
    )
